"""memory_opt_level=1 recomputes cheap activations in backward instead of saving them."""

import copy
import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ort_dynamo
from parity import assert_all_on_ort


def _saved_for_backward(level):
    ort_dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.LayerNorm(32)) for _ in range(3)])
    x = torch.randn(8, 32, requires_grad=True)
    out = torch.compile(model, backend="ort", options={"memory_opt_level": level})(x)
    out.square().sum().backward()
    assert_all_on_ort()
    forward = next(g for g in ort_dynamo.report().graphs if g.kind == "forward")
    return forward.outputs - 1, out.detach(), x.grad, [p.grad for p in model.parameters()]


def test_recompute_saves_fewer_tensors_with_identical_gradients():
    saved_keep, out_keep, xgrad_keep, grads_keep = _saved_for_backward(0)
    saved_recompute, out_re, xgrad_re, grads_re = _saved_for_backward(1)
    assert saved_recompute < saved_keep, (saved_recompute, saved_keep)
    torch.testing.assert_close(out_re, out_keep)
    torch.testing.assert_close(xgrad_re, xgrad_keep, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads_re, grads_keep):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _saved_shapes(level, model, x):
    """Shapes of the tensors the compiled forward saves for backward, and the gradients."""
    ort_dynamo.reset()
    saved = []

    def pack(tensor):
        saved.append(tuple(tensor.shape))
        return tensor

    compiled = torch.compile(copy.deepcopy(model), backend="ort", options={"memory_opt_level": level})
    compiled(x).sum().backward()  # compiles
    compiled.zero_grad()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = compiled(x).sum()
    loss.backward()
    assert_all_on_ort()
    return saved, [p.grad for p in compiled.parameters()]


def test_recompute_does_not_save_an_activation_the_next_linear_reads():
    """Eager saves both a GELU's input (for its own gradient) and its output (for the next
    Linear's weight gradient). At level 1 the output is recomputed from the input in backward:
    the [tokens, 4 * hidden] tensors saved go from two to one, the gradients stay eager's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
    x = torch.randn(32, 16)
    model(x).sum().backward()
    wide = (32, 64)
    saved_keep, grads_keep = _saved_shapes(0, model, x)
    saved_recompute, grads_recompute = _saved_shapes(1, model, x)
    assert saved_keep.count(wide) == 2, saved_keep
    assert saved_recompute.count(wide) == 1, saved_recompute
    for got_keep, got_recompute, (name, want) in zip(grads_keep, grads_recompute, model.named_parameters()):
        torch.testing.assert_close(got_keep, want.grad, rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(got_recompute, want.grad, rtol=1e-5, atol=1e-6, msg=name)


class _Attention(nn.Module):
    """Self-attention through F.scaled_dot_product_attention, with one kind of mask."""

    def __init__(self, variant, dim=32, heads=4, seq=24):
        super().__init__()
        self.variant, self.heads = variant, heads
        self.kv_heads = heads // 2 if variant == "gqa" else heads
        self.q, self.o = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * dim * self.kv_heads // heads)
        keep = torch.rand(2, 1, seq, seq, generator=torch.Generator().manual_seed(1)) > 0.3
        keep[..., 0] = True
        if variant == "rows_masked_whole":  # padded queries: eager gives their rows zeros
            keep[0, :, 5:9] = False
        self.register_buffer("keep", keep)

    def forward(self, x):
        b, s, d = x.shape
        q = self.q(x).view(b, s, self.heads, -1).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2 * self.kv_heads, -1).transpose(1, 2).chunk(2, dim=1)
        mask = {"bool_mask": self.keep, "rows_masked_whole": self.keep,
                "float_mask": torch.zeros(self.keep.shape).masked_fill(~self.keep, float("-inf"))}.get(self.variant)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.variant == "causal",
                                             enable_gqa=self.variant == "gqa")
        return self.o(out.transpose(1, 2).reshape(b, s, d))


@pytest.mark.parametrize("variant", ["plain", "causal", "bool_mask", "float_mask", "gqa", "rows_masked_whole"])
def test_recompute_keeps_no_attention_probabilities_and_gives_eagers_gradients(variant):
    """Level 0 keeps attention's [batch, heads, q, kv] probabilities for backward; level 1 keeps
    each row's logsumexp and recomputes them there, as flash attention does (BERT: 8 MB less
    per step). Both give eager's gradients, with a row its mask hides whole too (zeros)."""
    torch.manual_seed(0)
    model = _Attention(variant)
    x = torch.randn(2, 24, 32)
    model(x).sum().backward()
    probabilities = {(2, 4, 24, 24), (8, 24, 24)}
    saved_keep, grads_keep = _saved_shapes(0, model, x)
    saved_recompute, grads_recompute = _saved_shapes(1, model, x)
    assert probabilities & set(saved_keep), saved_keep
    assert not probabilities & set(saved_recompute), saved_recompute
    for got_keep, got_recompute, (name, want) in zip(grads_keep, grads_recompute, model.named_parameters()):
        torch.testing.assert_close(got_keep, want.grad, rtol=1e-4, atol=1e-5, msg=name)
        torch.testing.assert_close(got_recompute, want.grad, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("precision", ["autocast_bf16", "bf16", "fp16"])
def test_recompute_under_autocast_and_in_half_types_keeps_no_attention_probabilities(precision):
    """Under autocast, level 1 takes attention's operands in autocast's dtype, as torch's SDPA
    does, and runs without it: half products, softmax and logsumexp in float32. Its gradients
    are as close to eager's as level 0's are."""
    torch.manual_seed(0)
    model, x = _Attention("float_mask"), torch.randn(2, 24, 32)
    if precision != "autocast_bf16":
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
        model, x = model.to(dtype), x.to(dtype)  # the float mask stays float32, as torch allows
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "autocast_bf16"):
        model(x).sum().backward()
        saved_keep, grads_keep = _saved_shapes(0, model, x)
        saved_recompute, grads_recompute = _saved_shapes(1, model, x)
    probabilities = {(2, 4, 24, 24), (8, 24, 24)}
    assert probabilities & set(saved_keep), saved_keep
    assert not probabilities & set(saved_recompute), saved_recompute
    for got_keep, got_recompute, (name, want) in zip(grads_keep, grads_recompute, model.named_parameters()):
        tolerance = {"rtol": 0.02, "atol": 0.02 * want.grad.abs().max().item()}
        torch.testing.assert_close(got_keep, want.grad, **tolerance, msg=name)
        torch.testing.assert_close(got_recompute, want.grad, **tolerance, msg=name)


@pytest.mark.parametrize("level", [0, 1])
def test_attention_dropout_at_either_level_gives_the_gradients_of_the_mask_it_drew(level):
    """ORT draws its own dropout mask, so eager cannot be the reference. With an identity value
    the output is the dropped probabilities themselves, which shows the mask; the gradients
    must be those of exact attention with that mask. Level 1 keeps the mask (one byte per
    probability) and no probabilities."""
    torch.manual_seed(0)
    seq, p = 16, 0.3
    q, k = (torch.randn(2, 4, seq, 8, requires_grad=True) for _ in range(2))
    v = torch.eye(seq).expand(2, 4, seq, seq).clone().requires_grad_()
    compiled = torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True),
                             backend="ort", options={"memory_opt_level": level})
    first = compiled(q, k, v)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append((tuple(t.shape), t.dtype)) or t, lambda t: t):
        out = compiled(q, k, v)
    assert not torch.equal(first, out), "dropout must draw a new mask each call"
    weights = torch.randn_like(out)
    (out * weights).sum().backward()
    assert_all_on_ort()

    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    kept = out.detach() != 0
    assert 0.6 < kept.sum() / (causal.sum() * 8) < 0.8  # 1 - p of what the causal mask lets through
    wide = [t.detach().double().requires_grad_() for t in (q, k, v)]
    scores = (wide[0] @ wide[1].transpose(-1, -2) / 8 ** 0.5).masked_fill(~causal, float("-inf"))
    want = (torch.softmax(scores, -1) * kept / (1 - p)) @ wide[2]
    (want * weights.double()).sum().backward()
    torch.testing.assert_close(out.double(), want.detach(), rtol=1e-5, atol=1e-6)
    for got, reference in zip((q, k, v), wide):
        torch.testing.assert_close(got.grad.double(), reference.grad, rtol=1e-5, atol=1e-6)
    probabilities = ((2, 4, seq, seq), torch.float32)  # (v, [8, seq, seq], is saved at both levels)
    if level == 1:
        assert ((2, 4, seq, seq), torch.bool) in saved and probabilities not in saved, saved
    else:
        assert probabilities in saved, saved


def test_the_recompute_partition_merges_repeated_calls_but_not_random_ones_or_signed_zeros():
    """Level 1 removes common subexpressions from the joint graph before the min-cut (with its
    own pass: torch's imports Inductor's pattern matcher, 0.6 s of a fresh process's first step)."""
    from ort_dynamo.capture import _without_common_subexpressions

    aten = torch.ops.aten

    def joint(x):
        first, again, negative_zero = aten.add.Tensor(x, 0.0), aten.add.Tensor(x, 0.0), aten.add.Tensor(x, -0.0)
        return aten.mul.Tensor(first, again), negative_zero, aten.rand_like.default(x), aten.rand_like.default(x)

    graph = _without_common_subexpressions(torch.fx.symbolic_trace(joint).graph)
    targets = [n.target for n in graph.nodes if n.op == "call_function"]
    assert targets.count(aten.add.Tensor) == 2 and targets.count(aten.rand_like.default) == 2, targets
    x = torch.tensor([-0.0, 1.0])
    product, signed = torch.fx.GraphModule(torch.nn.Module(), graph)(x)[:2]
    torch.testing.assert_close(product, x * x)
    assert torch.signbit(signed[0])  # -0.0 + -0.0 is -0.0; the +0.0 sum would be +0.0


def test_a_recomputing_compile_does_not_import_inductors_pattern_matcher():
    import subprocess
    import sys

    code = ("import sys, torch, torch.nn as nn\n"
            "m = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))\n"
            "torch.compile(m, backend='ort', options={'memory_opt_level': 1})(torch.randn(4, 8)).sum().backward()\n"
            "import ort_dynamo; assert ort_dynamo.report().fallback_nodes == 0\n"
            "print('torch._inductor.pattern_matcher' in sys.modules)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "False"


def test_a_graph_whose_min_cut_fails_keeps_its_activations_and_says_so(monkeypatch, tmp_path):
    """The min-cut is a solver over torch internals; if it raises, the graph is partitioned as
    at level 0 (it saves what eager saves), trains with eager's gradients, and the report and a
    warning say why."""
    from torch._functorch import partitioners

    from ort_dynamo.report import format_report

    def failing_min_cut(*args, **kwargs):
        raise RuntimeError("the solver found no cut")

    monkeypatch.setattr(partitioners, "min_cut_rematerialization_partition", failing_min_cut)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
    x = torch.randn(32, 16)
    model(x).sum().backward()
    with pytest.warns(UserWarning, match="keeps every activation .*RuntimeError: the solver found no cut"):
        saved, grads = _saved_shapes(1, model, x)
    assert saved.count((32, 64)) == 2, saved  # the GELU's input and output, as eager saves them
    for got, (name, want) in zip(grads, model.named_parameters()):
        torch.testing.assert_close(got, want.grad, rtol=1e-5, atol=1e-6, msg=name)
    report = ort_dynamo.report()
    assert report.recompute_failures == ["RuntimeError: the solver found no cut"]
    assert "min-cut failed" in str(report)
    report.save(tmp_path / "report.json")
    with open(tmp_path / "report.json") as fh:
        assert "the solver found no cut" in format_report(json.load(fh))
