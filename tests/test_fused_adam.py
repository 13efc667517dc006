"""FusedAdam: one ORT run per (device, dtype) group per step, matching torch's Adam/AdamW."""

import copy
import math

import pytest
import torch

import ort_dynamo
from ort_dynamo import _kernels
from ort_dynamo.optim import AdamWMode, FusedAdam


class TransformersAdamW(torch.optim.Optimizer):
    """transformers' (pre-5.0) ``AdamW``, the reference of ``ADAMW_TRANSFORMERS``."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0, correct_bias=True):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      correct_bias=correct_bias))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                beta1, beta2 = group["betas"]
                state["step"] += 1
                exp_avg.mul_(beta1).add_(p.grad, alpha=1.0 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(p.grad, p.grad, value=1.0 - beta2)
                denom = exp_avg_sq.sqrt().add_(group["eps"])
                step_size = group["lr"]
                if group["correct_bias"]:
                    step_size = step_size * math.sqrt(1.0 - beta2 ** state["step"]) / (1.0 - beta1 ** state["step"])
                p.addcdiv_(exp_avg, denom, value=-step_size)
                if group["weight_decay"] > 0.0:
                    p.add_(p, alpha=-group["lr"] * group["weight_decay"])


REFERENCES = {
    AdamWMode.ADAM_L2_REGULARIZATION: torch.optim.Adam,
    AdamWMode.ADAMW_TRANSFORMERS: TransformersAdamW,
    AdamWMode.ADAMW_TORCH: torch.optim.AdamW,
}


def mlp(dtype=torch.float32) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 32),
                               torch.nn.GELU(), torch.nn.Linear(32, 4)).to(dtype)


def set_same_grads(model, *others, seed):
    """Eager grads of ``model`` copied to the others: only the optimizers differ."""
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
    model.zero_grad(set_to_none=True)
    torch.nn.functional.mse_loss(model(x.to(next(model.parameters()).dtype)).float(), y).backward()
    for other in others:
        for p, q in zip(model.parameters(), other.parameters()):
            q.grad = p.grad.to(q.dtype).clone()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("mode", list(AdamWMode))
def test_100_steps_match_torch_reference(mode):
    model = mlp()
    ref_model = copy.deepcopy(model)
    kwargs = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)
    opt = FusedAdam(model.parameters(), adam_w_mode=mode, **kwargs)
    ref = REFERENCES[mode](ref_model.parameters(), **kwargs)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref, lambda s: 1.0 / (1 + s))
    ptrs = [p.data_ptr() for p in model.parameters()]
    for step in range(100):
        set_same_grads(ref_model, model, seed=step)
        opt.step()
        ref.step()
        sched.step()
        ref_sched.step()
        if step == 0:
            state_ptrs = [opt.state[p][k].data_ptr() for p in model.parameters() for k in ("exp_avg", "exp_avg_sq")]
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert rel_err(p, q) < 1e-6
        assert rel_err(opt.state[p]["exp_avg"], ref.state[q]["exp_avg"]) < 1e-6
        assert rel_err(opt.state[p]["exp_avg_sq"], ref.state[q]["exp_avg_sq"]) < 1e-6
        assert float(opt.state[p]["step"]) == 100
    # The parameters moved (the test can fail), in place, in one ORT run per step,
    # and the lr schedule changed lr every step without building a new graph.
    assert rel_err(next(model.parameters()), next(mlp().parameters())) > 0.1
    assert [p.data_ptr() for p in model.parameters()] == ptrs
    assert [opt.state[p][k].data_ptr() for p in model.parameters() for k in ("exp_avg", "exp_avg_sq")] == state_ptrs
    assert opt.ort_runs == 100
    assert opt.graphs_built == 1


def test_defaults_are_onnxruntime_training_defaults():
    opt = FusedAdam([torch.nn.Parameter(torch.ones(2))])
    group = opt.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (1e-3, (0.9, 0.999), 1e-6, 0.0)
    assert group["bias_correction"] is True
    assert opt.adam_w_mode == AdamWMode.ADAMW_TRANSFORMERS
    assert opt.set_grad_none is True


def test_one_run_per_device_dtype_group_and_param_group_changes_do_not_rebuild():
    a, b = torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))
    c = torch.nn.Parameter(torch.randn(4, 4, dtype=torch.bfloat16))
    opt = FusedAdam([{"params": [a]}, {"params": [b, c], "lr": 0.1}], adam_w_mode=AdamWMode.ADAMW_TORCH)
    for step in range(3):
        for p in (a, b, c):
            p.grad = torch.randn_like(p)
        opt.param_groups[1]["lr"] = 0.1 / (step + 1)
        opt.param_groups[1]["betas"] = (0.8 + 0.01 * step, 0.99)
        opt.param_groups[0]["weight_decay"] = 0.01 * step
        opt.step()
    assert opt.ort_runs == 3 * 3  # group 0 (fp32), group 1 fp32, group 1 bf16
    assert opt.graphs_built == 3


def test_params_without_grad_are_skipped_and_keep_no_state():
    used, frozen = torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(3))
    before = frozen.detach().clone()
    opt = FusedAdam([used, frozen], lr=0.1)
    used.grad = torch.ones(3)
    opt.step()
    assert torch.equal(frozen, before)
    assert frozen not in opt.state and float(opt.state[used]["step"]) == 1
    # When it gets a grad later, its own step count starts at 1 (bias correction per param).
    used.grad, frozen.grad = torch.ones(3), torch.ones(3)
    opt.step()
    assert float(opt.state[used]["step"]) == 2 and float(opt.state[frozen]["step"]) == 1
    ref = torch.optim.AdamW([frozen.detach().clone().requires_grad_()], lr=0.1, eps=1e-6, weight_decay=0.0)
    ref.param_groups[0]["params"][0].grad = torch.ones(3)
    # First step of ADAMW_TRANSFORMERS with wd=0 equals torch's AdamW up to eps placement.
    ref_p = ref.param_groups[0]["params"][0]
    ref_p.data.copy_(before)
    ref.step()
    torch.testing.assert_close(frozen.detach(), ref_p.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_params_keep_fp32_state(dtype):
    model = mlp(dtype)
    # Reference: torch AdamW on float32 copies, rounded to the low dtype after each step.
    ref_model = mlp().to(torch.float32)
    ref_model.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    opt = FusedAdam(model.parameters(), lr=1e-2, eps=1e-8, weight_decay=0.01, adam_w_mode=AdamWMode.ADAMW_TORCH)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, eps=1e-8, weight_decay=0.01)
    for step in range(10):
        set_same_grads(model, ref_model, seed=step)
        opt.step()
        ref.step()
        with torch.no_grad():
            for q in ref_model.parameters():
                q.copy_(q.to(dtype).float())
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert p.dtype == dtype
        assert opt.state[p]["exp_avg"].dtype == torch.float32
        torch.testing.assert_close(opt.state[p]["exp_avg_sq"], ref.state[q]["exp_avg_sq"], rtol=1e-2, atol=1e-7)
        # At most a few parameters differ, by one rounding step of the low dtype.
        ulp = torch.finfo(dtype).eps * q.abs().max()
        assert (p.float() - q).abs().max() <= 2 * ulp
        assert (p.float() != q).float().mean() < 0.05


def test_state_dict_round_trip_fused_adamw_fused_is_bit_exact():
    model = mlp()
    opt = FusedAdam(model.parameters(), lr=1e-2, eps=1e-8, weight_decay=0.1, adam_w_mode=AdamWMode.ADAMW_TORCH)
    for step in range(5):
        set_same_grads(model, seed=step)
        opt.step()
    saved = opt.state_dict()
    # Taking a checkpoint leaves training untouched: the live step counts keep advancing.
    live = copy.deepcopy(model)
    live_opt = FusedAdam(live.parameters(), adam_w_mode=AdamWMode.ADAMW_TORCH)
    live_opt.load_state_dict(saved)
    live_opt.state_dict()
    set_same_grads(live, seed=99)
    live_opt.step()
    assert float(live_opt.state[next(live.parameters())]["step"]) == 6
    assert float(live_opt.state_dict()["state"][0]["step"]) == 6
    assert set(saved["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    assert saved["state"][0]["step"].dtype == torch.float32 and saved["state"][0]["step"].dim() == 0

    torch_model = copy.deepcopy(model)
    adamw = torch.optim.AdamW(torch_model.parameters())
    adamw.load_state_dict(copy.deepcopy(saved))
    assert adamw.param_groups[0]["lr"] == 1e-2 and adamw.param_groups[0]["weight_decay"] == 0.1
    back = FusedAdam(copy.deepcopy(model).parameters(), adam_w_mode=AdamWMode.ADAMW_TORCH)
    back.load_state_dict(copy.deepcopy(adamw.state_dict()))
    again = back.state_dict()
    for idx, entry in saved["state"].items():
        for key, value in entry.items():
            assert torch.equal(again["state"][idx][key], value), (idx, key)
    for g, h in zip(saved["param_groups"], again["param_groups"]):
        assert {k: g[k] for k in ("lr", "betas", "eps", "weight_decay", "params")} == \
               {k: h[k] for k in ("lr", "betas", "eps", "weight_decay", "params")}

    # Training on from the checkpoint: torch's AdamW and FusedAdam stay together.
    fused_model = copy.deepcopy(model)
    fused = FusedAdam(fused_model.parameters(), adam_w_mode=AdamWMode.ADAMW_TORCH)
    fused.load_state_dict(saved)
    for step in range(5, 15):
        set_same_grads(torch_model, fused_model, seed=step)
        adamw.step()
        fused.step()
    for p, q in zip(fused_model.parameters(), torch_model.parameters()):
        assert rel_err(p, q) < 1e-6
    assert float(fused.state[next(fused_model.parameters())]["step"]) == 15
    # Loading copied the tensors: the saved checkpoint was not written by training.
    assert float(saved["state"][0]["step"]) == 5


def test_closure_zero_grad_and_errors():
    p = torch.nn.Parameter(torch.randn(4))
    opt = FusedAdam([p], lr=0.1)

    def closure():
        opt.zero_grad()
        loss = (p ** 2).sum()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert loss.item() > 0 and opt.ort_runs == 1
    opt.zero_grad(set_to_none=False)  # set_grad_none=True wins, as in ORT's FusedAdam
    assert p.grad is None
    keep = FusedAdam([p], set_grad_none=False)
    p.grad = torch.ones(4)
    keep.zero_grad(set_to_none=False)
    assert torch.equal(p.grad, torch.zeros(4))

    emb = torch.nn.Embedding(10, 3, sparse=True)
    sparse_opt = FusedAdam(emb.parameters())
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse gradients"):
        sparse_opt.step()
    with pytest.raises(ValueError, match="learning rate"):
        FusedAdam([p], lr=-1.0)
    with pytest.raises(ValueError, match="betas"):
        FusedAdam([p], betas=(0.9, 1.5))
    with pytest.raises(ValueError, match="adam_w_mode"):
        FusedAdam([p], adam_w_mode=7)
    with pytest.raises(TypeError, match="int64"):
        FusedAdam([torch.zeros(3, dtype=torch.int64)]).step()
    with pytest.raises(ValueError, match="amsgrad"):
        FusedAdam([p]).load_state_dict(torch.optim.Adam([p], amsgrad=True).state_dict())
    moved = FusedAdam([p])
    p.grad = torch.ones(4)
    moved.step()
    p.data = p.data.double()
    p.grad = torch.ones(4, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="create the optimizer after"):
        moved.step()


def test_non_contiguous_grad_and_channels_last_param():
    conv = torch.nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    ref = copy.deepcopy(conv)
    opt = FusedAdam(conv.parameters(), lr=0.1, eps=1e-8, adam_w_mode=AdamWMode.ADAMW_TORCH)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.1, eps=1e-8, weight_decay=0.0)
    for p, q in zip(conv.parameters(), ref.parameters()):
        g = torch.randn(p.shape[::-1]).permute(*reversed(range(p.dim())))  # transposed layout
        p.grad, q.grad = g, g.clone()
    opt.step()
    ref_opt.step()
    for p, q in zip(conv.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


@pytest.mark.cuda
def test_cuda_matches_torch_adamw():
    model = mlp().cuda()
    ref_model = copy.deepcopy(model)
    opt = FusedAdam(model.parameters(), lr=1e-2, eps=1e-8, weight_decay=0.05, adam_w_mode=AdamWMode.ADAMW_TORCH)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, eps=1e-8, weight_decay=0.05, foreach=False)
    for step in range(20):
        x = torch.randn(8, 16, device="cuda")
        ref_model.zero_grad()
        ref_model(x).square().mean().backward()
        for p, q in zip(model.parameters(), ref_model.parameters()):
            p.grad = q.grad.clone()
        opt.step()
        ref.step()
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert rel_err(p, q) < 1e-6
    assert opt.ort_runs == 20 and opt.graphs_built == 1


def test_large_tensors_update_in_place_with_multithreaded_kernels():
    """Input and output share storage; ORT's parallel elementwise kernels must not mix them up."""
    p = torch.nn.Parameter(torch.randn(1 << 20))
    q = torch.nn.Parameter(p.detach().clone())
    opt = FusedAdam([p], lr=1e-2, eps=1e-8, weight_decay=0.1, adam_w_mode=AdamWMode.ADAMW_TORCH)
    ref = torch.optim.AdamW([q], lr=1e-2, eps=1e-8, weight_decay=0.1)
    ptr = p.data_ptr()
    for _ in range(3):
        g = torch.randn(1 << 20)
        p.grad, q.grad = g, g.clone()
        opt.step()
        ref.step()
    assert p.data_ptr() == ptr
    torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(opt.state[p]["exp_avg_sq"], ref.state[q]["exp_avg_sq"], rtol=1e-6, atol=1e-12)


def test_public_path():
    import ort_dynamo

    assert ort_dynamo.optim.FusedAdam is FusedAdam and ort_dynamo.optim.AdamWMode is AdamWMode


@pytest.mark.skipif(not _kernels.available(), reason="no C compiler to build kernels with")
def test_on_cpu_each_parameter_updates_in_one_generated_kernel_with_the_same_bits(monkeypatch):
    """On CPU the elementwise update runs as a pointwise kernel (one pass over p, g, m, v in
    place of one per op), once built; before that, and without kernels, as ORT's ops. The
    arithmetic is the same, op by op: the same bits."""
    import ort_dynamo

    shapes = [(512, 300), (300,), (7,), (1 << 16,)]  # big and tiny, every size one kernel
    params = {k: [torch.nn.Parameter(torch.randn(s, generator=torch.Generator().manual_seed(i)))
                  for i, s in enumerate(shapes)] for k in ("kernel", "ops")}
    opts = {k: FusedAdam(ps, lr=1e-2, eps=1e-8, weight_decay=0.1, adam_w_mode=AdamWMode.ADAMW_TORCH)
            for k, ps in params.items()}
    pointers = [p.data_ptr() for p in params["kernel"]]
    for step in range(4):
        for k in ("ops", "kernel"):
            for i, p in enumerate(params[k]):
                p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * step + i))
            with monkeypatch.context() as env:
                if k == "ops":
                    env.setenv("ORT_DYNAMO_POINTWISE_KERNELS", "0")
                opts[k].step()
        ort_dynamo.wait_for_kernels()
    (kernel_session,), (ops_session,) = opts["kernel"]._sessions.values(), opts["ops"]._sessions.values()
    assert kernel_session.kernels == 1 and ops_session.kernels == 0
    assert [p.data_ptr() for p in params["kernel"]] == pointers  # updated in place
    for p, q in zip(params["kernel"], params["ops"]):
        assert torch.equal(p, q)
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opts["kernel"].state[p][name], opts["ops"].state[q][name])


@pytest.mark.parametrize("failure", ["build", "load", "load one built earlier"])
def test_optimizer_kernels_that_cannot_be_built_or_loaded_leave_the_plain_graph_running(monkeypatch, tmp_path,
                                                                                         failure):
    import concurrent.futures

    library = concurrent.futures.Future()
    bad_library = tmp_path / "kernels.so"
    bad_library.write_bytes(b"not a shared object")
    if failure == "build":
        library.set_exception(_kernels.KernelBuildError("cc: not found"))
    else:  # built, but not a library ORT can load
        library.set_result(str(bad_library))
    monkeypatch.setattr(_kernels, "available", lambda: True)
    monkeypatch.setattr(_kernels, "build", lambda kernels, cache_dir="", openmp=False: library)
    earlier = str(bad_library) if failure == "load one built earlier" else None
    monkeypatch.setattr(_kernels, "built", lambda kernels, cache_dir="", openmp=False: earlier)
    p = torch.nn.Parameter(torch.randn(4096))
    q = torch.nn.Parameter(p.detach().clone())
    opt = FusedAdam([p], lr=1e-2, eps=1e-8, weight_decay=0.1, adam_w_mode=AdamWMode.ADAMW_TORCH)
    ref = torch.optim.AdamW([q], lr=1e-2, eps=1e-8, weight_decay=0.1)
    with pytest.warns(UserWarning, match="optimizer graph runs without its pointwise kernels"):
        for _ in range(3):
            g = torch.randn(4096)
            p.grad, q.grad = g, g.clone()
            opt.step()
            ref.step()
    assert next(iter(opt._sessions.values())).kernels == 0
    torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


@pytest.mark.skipif(not _kernels.available(), reason="no C compiler to build kernels with")
def test_kernels_built_by_an_earlier_process_run_from_the_first_step_without_a_plain_session(monkeypatch):
    """The update's kernel is the same for every model, so after the first process on a
    machine it is on disk: the first step runs it, and no session of the plain graph (its
    memory, its slower run) is made."""
    import onnxruntime

    from ort_dynamo.optim import _session

    warm = [torch.nn.Parameter(torch.randn(64))]
    warm_opt = FusedAdam(warm, adam_w_mode=AdamWMode.ADAMW_TORCH)
    warm[0].grad = torch.randn(64)
    warm_opt.step()
    ort_dynamo.wait_for_kernels()  # on disk now, as an earlier process would have left it

    sessions = []

    class CountingSession(onnxruntime.InferenceSession):
        def __init__(self, *args, **kwargs):
            sessions.append(self)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(_session.ort, "InferenceSession", CountingSession)
    params = [torch.nn.Parameter(torch.randn(s)) for s in [(300, 20), (20,)]]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = FusedAdam(params, lr=1e-2, eps=1e-8, weight_decay=0.1, adam_w_mode=AdamWMode.ADAMW_TORCH)
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, eps=1e-8, weight_decay=0.1)
    for p, r in zip(params, ref):
        p.grad = torch.randn(p.shape)
        r.grad = p.grad.clone()
    opt.step()
    ref_opt.step()
    assert len(sessions) == 1 and next(iter(opt._sessions.values())).kernels == 1
    for p, r in zip(params, ref):
        torch.testing.assert_close(p, r, rtol=1e-6, atol=1e-7)


def test_a_graph_that_could_overwrite_a_tensor_before_reading_it_is_refused():
    """Outputs are bound over their inputs: every reader of ``x`` must run before ``x_out``
    is written, i.e. be an ancestor of its writer."""
    from ort_dynamo.optim._graphs import F32, _Builder, _vec

    b = _Builder()
    b.op("Identity", "x", out="x_out")
    b.op("Neg", "x", out="y")  # reads x, but nothing orders it before the write of x_out
    with pytest.raises(AssertionError, match=r"x_out could be written before \['Neg'\] read x"):
        b.model([_vec("x", F32, 4)], [_vec("x_out", F32, 4), _vec("y", F32, 4)], "unordered")
    ordered = _Builder()
    y = ordered.op("Neg", "x", out="y")
    ordered.op("Add", "x", y, out="x_out")
    ordered.model([_vec("x", F32, 4)], [_vec("x_out", F32, 4), _vec("y", F32, 4)], "ordered")
