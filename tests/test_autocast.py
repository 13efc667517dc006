"""torch.autocast(cpu, bfloat16) training steps run on ORT with eager's dtypes and values.

Autocast's casts are recorded in the graph (matmuls in bf16, softmax/loss in fp32), so ORT
must hand back the same dtypes. bf16 has an 8-bit mantissa: outputs are compared with
bf16 tolerances (rtol 1.6e-2, one bf16 ulp), fp32 master gradients with rtol 2e-2 /
atol 2e-3 (a gradient sums many bf16 products, and one ulp flip of a bf16 intermediate
moves the sum by more than an fp32 ulp).
"""

from __future__ import annotations

import copy

import pytest
import torch

import ort_dynamo

BF16_TOL = dict(rtol=1.6e-2, atol=1e-3)
GRAD_TOL = dict(rtol=2e-2, atol=2e-3)


class Classifier(torch.nn.Module):
    def __init__(self, activation: torch.nn.Module) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(50, 32)
        self.proj = torch.nn.Linear(32, 64)
        self.norm = torch.nn.LayerNorm(64)
        self.act = activation
        self.attn = torch.nn.Linear(64, 64)
        self.head = torch.nn.Linear(64, 5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.act(self.norm(self.proj(self.embed(ids))))
        scores = torch.softmax(self.attn(h) @ h.transpose(1, 2) / 8.0, dim=-1)
        return self.head((scores @ h).mean(1))


def bf16_step(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(ids)
        loss = torch.nn.functional.cross_entropy(logits, labels)
    return logits, loss


def run_steps(model, step, batch, steps: int = 2):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    results = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        logits, loss = step(*batch)
        loss.backward()
        results.append((logits.detach(), loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        opt.step()
    return results


def check_autocast_training(activation: torch.nn.Module) -> None:
    torch.manual_seed(0)
    model = Classifier(activation)
    batch = (torch.randint(0, 50, (4, 6)), torch.randint(0, 5, (4,)))
    eager_model, ort_model = copy.deepcopy(model), copy.deepcopy(model)
    eager = run_steps(eager_model, lambda *b: bf16_step(eager_model, *b), batch)
    compiled = torch.compile(lambda *b: bf16_step(ort_model, *b), backend="ort", dynamic=False)
    ort = run_steps(ort_model, compiled, batch)

    report = ort_dynamo.report()
    assert report.fallback_nodes == 0, "\n".join(str(f) for f in report.fallbacks)
    assert report.ort_nodes > 0
    for (e_logits, e_loss, e_grads), (o_logits, o_loss, o_grads) in zip(eager, ort):
        assert o_logits.dtype == e_logits.dtype == torch.bfloat16
        assert o_loss.dtype == e_loss.dtype == torch.float32
        torch.testing.assert_close(o_logits, e_logits, **BF16_TOL)
        torch.testing.assert_close(o_loss, e_loss, **BF16_TOL)
        for name, grad in e_grads.items():
            assert o_grads[name].dtype == grad.dtype == torch.float32, name
            torch.testing.assert_close(o_grads[name], grad, **GRAD_TOL, msg=lambda m: f"grad of {name}: {m}")


def test_autocast_bf16_training_relu():
    check_autocast_training(torch.nn.ReLU())


def test_autocast_bf16_training_gelu():
    check_autocast_training(torch.nn.GELU())


def test_bf16_clamps_with_bounds_run_on_ort():
    # hardtanh's bounds are CastLike outputs inside torchlib's function, untyped after
    # inlining: the bf16 -> fp32 rewrite missed them and ORT refused Clip(float, bfloat16).
    import torch.nn.functional as F

    x = torch.tensor([1.0, 3.0, 0.25, 7.0, 2.0, -3.0], dtype=torch.bfloat16, requires_grad=True)
    for fn in (lambda x: F.hardtanh(x, 0.5, 2.5), F.relu6):
        ort_dynamo.reset()
        compiled = torch.compile(fn, backend="ort", options={"fallback_policy": "DISABLE"})
        out, expected = compiled(x), fn(x)
        assert out.dtype == torch.bfloat16 and torch.equal(out, expected)
        assert torch.equal(torch.autograd.grad(out.sum(), x)[0], torch.autograd.grad(expected.sum(), x)[0])


def test_a_bfloat16_gathers_gradient_runs_on_ort_though_its_scatter_add_has_no_bfloat16_kernel():
    """ORT's CPU ScatterElements and ScatterND take bfloat16 only without a reduction: the
    scatter-add of a gather's gradient (Falcon's, XLNet's and DeBERTa's under autocast) failed
    at run time and its partition ran in PyTorch. It is computed in float32 and rounded, as the
    ops ORT has no bfloat16 kernel for are."""
    torch.manual_seed(0)
    x = torch.randn(16, 32, dtype=torch.bfloat16, requires_grad=True)
    index = torch.randint(0, 32, (16, 24))  # repeated columns: their gradients add up

    def fn(x, index):
        return torch.gather(x * 2, 1, index).float().square().sum()

    compiled = torch.compile(fn, backend="ort")
    compiled(x, index).backward()
    got, x.grad = x.grad.clone(), None
    fn(x, index).backward()
    assert ort_dynamo.report().fallback_nodes == 0, str(ort_dynamo.report())
    # eager rounds each addition to bfloat16, ORT the float32 sum once
    torch.testing.assert_close(got.float(), x.grad.float(), rtol=2 ** -6, atol=0)


@pytest.mark.parametrize("layer", ["gather", "adaptive_max_pool", "scatter_reduce", "embedding"])
def test_float16_gradients_that_scatter_add_run_on_ort_though_its_cpu_scatters_do_not_add_float16(layer):
    """ORT's CPU ScatterElements adds no float16, and ScatterND reduces none: in a float16
    model a gather's and adaptive max pooling's gradients, and ``scatter_reduce``, failed at
    run time and their partition ran in PyTorch. Those scatters add in float32, rounded once. (An embedding's
    gradient takes another path; it is here as the third common scatter-add.)"""
    torch.manual_seed(0)
    if layer == "gather":
        x, index = torch.randn(16, 32, dtype=torch.float16, requires_grad=True), torch.randint(0, 32, (16, 24))

        def fn(x):
            return torch.gather(x * 2, 1, index).float().square().sum()
    elif layer == "adaptive_max_pool":  # 17 to 5: overlapping windows, whose gradients add up
        x = torch.randn(4, 3, 17, 17, dtype=torch.float16, requires_grad=True)

        def fn(x):
            return torch.nn.functional.adaptive_max_pool2d(x * 2, 5).float().square().sum()
    elif layer == "scatter_reduce":  # torchlib's lowering: values inlined without a type
        x, index = torch.randn(6, 8, dtype=torch.float16, requires_grad=True), torch.randint(0, 4, (6, 8))

        def fn(x):
            return (torch.ones(4, 8, dtype=x.dtype).scatter_reduce(0, index, x * 2, "sum", include_self=False)
                    .float().square().sum())
    else:
        x, index = torch.randn(32, 8, dtype=torch.float16, requires_grad=True), torch.randint(0, 32, (4, 24))

        def fn(x):
            return torch.nn.functional.embedding(index, x * 2).float().square().sum()

    ort_dynamo.reset()
    torch.compile(fn, backend="ort")(x).backward()
    got, x.grad = x.grad.clone(), None
    fn(x).backward()
    assert ort_dynamo.report().fallback_nodes == 0, str(ort_dynamo.report())
    # eager rounds each addition to float16, ORT the float32 sum once
    torch.testing.assert_close(got.float(), x.grad.float(), rtol=2 ** -9, atol=2 ** -14)


@pytest.mark.parametrize("name, fn", [
    ("log1p", torch.log1p), ("expm1", torch.expm1), ("atan2", lambda t: torch.atan2(t, t.flip(0))),
    ("logaddexp", lambda t: torch.logaddexp(t, t.flip(0))), ("logcumsumexp", lambda t: torch.logcumsumexp(t, 0)),
])
def test_float16_functions_whose_lowerings_test_for_infinities_run_on_ort(name, fn):
    """ORT's CPU IsInf has no float16 kernel (probed on onnxruntime 1.31), and these ops'
    lowerings use it (some on values they compute, which carry no type once inlined): in a
    float16 graph they failed at run time and ran in PyTorch. IsInf now reads them in float32."""
    torch.manual_seed(0)
    _all_on_ort_like_eager(fn, (torch.rand(8, 4) * 0.9).to(torch.float16).requires_grad_(), tolerance=2e-3)


@pytest.mark.parametrize("name, fn", [
    ("mean", lambda t: t.mean()), ("mv", lambda t: torch.mv(t, t[0])), ("dot", lambda t: torch.dot(t[0], t[1])),
    ("var_mean", lambda t: torch.var_mean(t, 1)[1] * torch.var_mean(t, 1)[0]),
    ("cross", lambda t: torch.linalg.cross(t[:, :3], t[:, 1:4])),
    ("scatter_reduce", lambda t: torch.ones(3, 5, dtype=t.dtype).scatter_reduce(
        0, torch.tensor([[0, 1, 2, 0, 1]] * 5), t, "amax", include_self=False)),
])
def test_bfloat16_results_that_lowerings_compute_in_float32_are_rounded_where_eager_rounds(name, fn):
    """torchlib's mean is a ReduceMean (computed in float32 here: ORT's CPU provider has no
    bfloat16 kernel) then a Squeeze that makes the op's bfloat16 result; the value between
    them was left float32, and ORT refused the model ("Type (tensor(bfloat16)) of output arg
    (mean) ... does not match expected type (tensor(float))"): the partition ran in PyTorch.
    Also mv, dot, var_mean, cross and scatter_reduce (whose inlined values carried no type).
    Now rounded to bfloat16 where the lowering's result is made, as eager rounds."""
    torch.manual_seed(0)
    _all_on_ort_like_eager(fn, torch.randn(5, 5, dtype=torch.bfloat16, requires_grad=True), tolerance=2e-2)


def _all_on_ort_like_eager(fn, x, tolerance):
    """``fn(x)`` and its gradient compiled: nothing in PyTorch, eager's dtype and values."""
    ort_dynamo.reset()
    torch._dynamo.reset()
    got = torch.compile(fn, backend="ort")(x)
    (got_grad,) = torch.autograd.grad(got.float().sum(), x)
    want = fn(x)
    (want_grad,) = torch.autograd.grad(want.float().sum(), x)
    assert ort_dynamo.report().fallback_nodes == 0, str(ort_dynamo.report())
    assert got.dtype == want.dtype == x.dtype
    torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(got_grad, want_grad, rtol=tolerance, atol=tolerance)


class HalfNorms(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 32)
        self.layer_norm = torch.nn.LayerNorm(32)
        self.group_norm = torch.nn.GroupNorm(4, 32)
        self.plain_norm = torch.nn.LayerNorm(32, elementwise_affine=False)
        self.head = torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.gelu(self.layer_norm(self.proj(x)))
        h = self.group_norm(h.unsqueeze(-1)).squeeze(-1)
        return self.head(self.plain_norm(h))


def ulp(dtype: torch.dtype, magnitude: float) -> float:
    """The spacing of ``dtype``'s numbers at ``magnitude``."""
    return magnitude * torch.finfo(dtype).eps


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_model_in_half_precision_with_layer_and_group_norms_trains_on_ort(dtype):
    # PyTorch computes these norms in float32 for a half input; so does ORT now (a float16
    # LayerNorm's statistics came back in a type ORT refused, and the graph ran in PyTorch).
    # Each of eager and ort is compared with the model in float32: ort must be as close as eager.
    torch.manual_seed(0)
    model = HalfNorms().to(dtype)
    compiled_model, reference = copy.deepcopy(model), copy.deepcopy(model).float()
    x = torch.randn(8, 16, dtype=dtype)
    eager_out, ort_out = model(x), torch.compile(compiled_model, backend="ort")(x)
    exact = reference(x.float())
    for out in (eager_out, ort_out, exact):
        out.float().square().sum().backward()

    report = ort_dynamo.report()
    assert report.fallback_nodes == 0, "\n".join(str(f) for f in report.fallbacks)
    assert ort_out.dtype == dtype
    pairs = [("output", eager_out, ort_out, exact)] + [
        (name, e.grad, o.grad, r.grad) for (name, e), o, r in
        zip(model.named_parameters(), compiled_model.parameters(), reference.parameters())]
    for name, eager, ort, want in pairs:
        assert ort.dtype == dtype, name
        eager_error = (eager.float() - want).abs().max().item()
        ort_error = (ort.float() - want).abs().max().item()
        assert ort_error <= max(2 * eager_error, ulp(dtype, want.abs().max().item())), (name, ort_error, eager_error)
