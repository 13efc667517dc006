"""FP16_Optimizer on DeepSpeed's fp16 optimizers: overflow checks and grad norms in one ORT graph.

Tests that need DeepSpeed skip when it is not importable; they run it on the CPU accelerator
(``DS_ACCELERATOR=cpu``). The stand-in tests always run: they drive the replacements through
objects with the attributes DeepSpeed's methods read, and check the refusal paths.
"""

import math
import os
import warnings

import pytest
import torch

from ort_dynamo.optim import FP16_Optimizer
from ort_dynamo.optim import _wrappers
from ort_dynamo.optim._wrappers import GradStats, fingerprint

# -- stand-ins for the names DeepSpeed's ZeRO module gives its methods (read via __globals__) ----

PIPE_REPLICATED = "ds_pipe_replicated"


def is_model_parallel_parameter(p):
    return getattr(p, "model_parallel", False)


class _Accel:
    def current_device_name(self):
        return "cpu"


def get_accelerator():
    return _Accel()


class dist:  # noqa: N801 (the name DeepSpeed's module uses)
    class ReduceOp:
        SUM, MAX = "sum", "max"
    calls = []

    @classmethod
    def all_reduce(cls, tensor, op=None, group=None):  # one rank: the reduction is the identity
        cls.calls.append(op)


def mask_nan_or_inf_with_val_inplace(x, device=None, val=-1.0):
    x.masked_fill_(~torch.isfinite(x), val)


class StandInZero:
    """What ZeRO 1/2's three methods read: groups, averaged grads, ranks, process groups."""

    def __init__(self, grads, model_parallel_rank=0):
        self.bit16_groups = [list(range(len(g))) for g in grads]
        self.averaged_gradients = dict(enumerate(grads))
        self.model_parallel_rank = model_parallel_rank
        self.device = "cpu"
        self.dp_process_group = None

    def _model_parallel_all_reduce(self, tensor, op):
        pass

    # Plain-torch references (float64 norms, like DeepSpeed's get_norm_dtype() on CPU/CUDA).
    def has_overflow_serial(self, params):
        return torch.tensor([any(not torch.isfinite(p.grad).all() for p in params if p.grad is not None)])

    def has_overflow_partitioned_grads_serial(self):
        grads = [g for i in range(len(self.bit16_groups)) for g in self.averaged_gradients[i] if g is not None]
        return torch.tensor([any(not torch.isfinite(g).all() for g in grads)])

    def get_grad_norm_direct(self, gradients, params, norm_type=2):
        grads = [g for g in gradients if not getattr(g, "_zero_padding", False)]
        total = 0.0
        for g, p in zip(grads, params):
            if getattr(p, PIPE_REPLICATED, False):
                continue
            if is_model_parallel_parameter(p) or self.model_parallel_rank == 0:
                total += torch.linalg.vector_norm(g.double(), ord=float(norm_type)).item() ** norm_type
        norm = torch.tensor(total ** (1.0 / norm_type), dtype=torch.float32)
        mask_nan_or_inf_with_val_inplace(norm)
        return norm


def _patch_stand_in(obj, stats):
    cls = type(obj)
    for method, make in (("has_overflow_serial", _wrappers._zero_has_overflow_serial),
                         ("has_overflow_partitioned_grads_serial",
                          _wrappers._zero_has_overflow_partitioned_grads_serial),
                         ("get_grad_norm_direct", _wrappers._zero_get_grad_norm_direct)):
        setattr(obj, method, make(getattr(cls, method), stats).__get__(obj))


def _grads(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(33, 7, generator=g).half() * 100, torch.randn(5, generator=g),
            torch.randn(2, 3, generator=g).bfloat16(), torch.randn(17, generator=g).double()]


def test_grad_stats_sum_of_squares_and_overflow_in_one_run():
    stats = GradStats()
    grads = _grads()
    sumsq, found = stats(grads)
    ref = sum(g.double().pow(2).sum() for g in grads)
    assert sumsq.dtype == torch.float64 and found.dtype == torch.bool
    assert sumsq.item() == pytest.approx(ref.item(), rel=1e-12) and not found
    # Finite float32 grads whose squares overflow float32: not an overflow (float64 sums).
    sumsq, found = stats([torch.full((4,), 1e30), grads[1]])
    assert not found and math.isfinite(sumsq.item())
    for i, bad in ((0, float("inf")), (2, float("nan")), (3, float("-inf")), (3, float("nan"))):
        broken = [g.clone() for g in grads]
        broken[i].view(-1)[1] = bad
        assert stats(broken)[1]
    assert stats.graphs_built == 2 and stats.ort_runs == 6
    # Non-contiguous and empty grads; no grads at all.
    sumsq, found = stats([grads[0].t(), torch.empty(0)])
    assert sumsq.item() == pytest.approx(grads[0].double().pow(2).sum().item(), rel=1e-12)
    assert stats([])[0].item() == 0.0


def test_zero_replacements_match_reference_on_stand_in():
    g = _grads(1)
    params = [torch.nn.Parameter(torch.zeros_like(x)) for x in g]
    pad = torch.zeros(3)
    pad._zero_padding = True
    params[1].ds_pipe_replicated = True  # counted once, by another pipeline stage
    params[3].model_parallel = True
    ref, fast = StandInZero([g[:2], g[2:]]), StandInZero([g[:2], g[2:]])
    stats = GradStats()
    _patch_stand_in(fast, stats)
    for rank in (0, 1):  # rank 1 counts only model-parallel params
        ref.model_parallel_rank = fast.model_parallel_rank = rank
        expect = ref.get_grad_norm_direct([pad] + g, params)
        got = fast.get_grad_norm_direct([pad] + g, params)
        assert got.dtype == torch.float32 and got.shape == ()
        torch.testing.assert_close(got, expect, rtol=1e-6, atol=0)
    assert dist.calls[-1] == dist.ReduceOp.SUM
    assert not fast.has_overflow_partitioned_grads_serial().item()
    fast.averaged_gradients[1][0][0, 0] = float("inf")
    assert fast.has_overflow_partitioned_grads_serial().tolist() == [True]
    fast.model_parallel_rank = 0
    assert fast.get_grad_norm_direct(g, [torch.zeros(1)] * 4).item() == -1.0  # DeepSpeed's invalid norm
    for p, x in zip(params, g):
        p.grad = x
    assert fast.has_overflow_serial(iter(params)).tolist() == [True]  # generators are fine
    # Inputs the graph does not take go to DeepSpeed's own method.
    assert fast.get_grad_norm_direct(g, params, norm_type=float("inf")) == ref.get_grad_norm_direct(
        g, params, norm_type=float("inf"))
    assert stats.ort_runs == 6


def _fake_deepspeed_class(name, module):
    cls = type(name, (StandInZero,), {})
    cls.__module__, cls.__qualname__ = module, name
    return cls


def test_unaudited_deepspeed_source_is_left_alone_with_a_warning():
    cls = _fake_deepspeed_class("DeepSpeedZeroOptimizer", "deepspeed.runtime.zero.stage_1_and_2")
    opt = cls([_grads()])
    with pytest.warns(UserWarning, match="source differs from the versions ort_dynamo checked"):
        out = FP16_Optimizer(opt)
    assert out is opt and opt._ort_dynamo_patched == ()
    assert "get_grad_norm_direct" not in vars(opt)  # DeepSpeed's method stays
    # Another DeepSpeed optimizer class (e.g. BF16_Optimizer, ZeRO-3): returned unchanged.
    other = _fake_deepspeed_class("BF16_Optimizer", "deepspeed.runtime.bf16_optimizer")([])
    with pytest.warns(UserWarning, match="returned unchanged"):
        assert FP16_Optimizer(other) is other
    # apex amp optimizers (recognised by amp's stash): returned unchanged too.
    apex_like = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1)
    apex_like._amp_stash = object()
    with pytest.warns(UserWarning, match="apex"):
        assert FP16_Optimizer(apex_like) is apex_like


def test_options_with_a_deepspeed_optimizer_are_rejected():
    opt = _fake_deepspeed_class("DeepSpeedZeroOptimizer", "deepspeed.runtime.zero.stage_1_and_2")([])
    with pytest.raises(TypeError, match="takes no options"):
        FP16_Optimizer(opt, max_grad_norm=1.0)
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        FP16_Optimizer(object())
    engine = type("DeepSpeedEngine", (torch.nn.Module,), {"__module__": "deepspeed.runtime.engine"})()
    with pytest.raises(TypeError, match="engine.optimizer"):
        FP16_Optimizer(engine)


def test_fingerprint_ignores_comments_and_docstrings_not_code():
    def f(x):
        """doc"""
        return x + 1  # comment
    documented = f

    def f(x):
        return x + 1
    plain = f

    def f(x):
        return x + 2
    changed = f
    assert fingerprint(documented) == fingerprint(plain) != fingerprint(changed)
    assert fingerprint(len) is None  # no Python source: never patched


# -- real DeepSpeed (CPU accelerator) ---------------------------------------------------------

@pytest.fixture(scope="module")
def deepspeed():
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    ds = pytest.importorskip("deepspeed")
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29531"), ("RANK", "0"),
                       ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)
    return ds


def _run_deepspeed(ds, monkeypatch, kind, patch, steps=5):
    from deepspeed.accelerator import get_accelerator
    accel = get_accelerator()
    if accel.device_name() == "cpu":  # DeepSpeed's CPU accelerator only claims fp16 with mkldnn-fp16
        monkeypatch.setattr(accel, "is_fp16_supported", lambda: True)
    if kind == "fused":
        # DeepSpeed picks its fused FP16_Optimizer for its CUDA FusedAdam; let it take torch's AdamW.
        import deepspeed.runtime.engine as engine_mod
        monkeypatch.setattr(engine_mod, "FusedAdam", torch.optim.AdamW)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    config = {"train_batch_size": 8, "steps_per_print": 10 ** 6, "gradient_clipping": 0.5,
              "fp16": {"enabled": True, "initial_scale_power": 10, "hysteresis": 1}}
    if kind.startswith("zero"):
        config["zero_optimization"] = {"stage": int(kind[-1])}
    engine, optimizer, _, _ = ds.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                                            config=config)
    if patch:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # audited version: patched without a warning
            assert FP16_Optimizer(optimizer) is optimizer
            patched = optimizer._ort_dynamo_patched
            assert FP16_Optimizer(optimizer) is optimizer and optimizer._ort_dynamo_patched is patched
    trace = []
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 16, generator=g).half(), torch.randn(8, 4, generator=g)
        x, y = x.to(engine.device), y.to(engine.device)
        loss = torch.nn.functional.mse_loss(engine(x).float(), y)
        engine.backward(loss * 1e6 if step == 2 else loss)  # step 2: fp16 grads overflow
        # The overflow check itself (DeepSpeed would also catch overflow through the norm).
        if kind.startswith("zero"):
            overflow = bool(optimizer.has_overflow_partitioned_grads_serial().item())
        else:
            overflow = optimizer.overflow_checker.has_overflow_serial([p for g in optimizer.fp16_groups for p in g])
        engine.step()
        norm = engine.get_global_grad_norm()
        trace.append((overflow, float(norm) if norm is not None else None, engine.optimizer.loss_scale))
    return optimizer, trace, [p.detach().clone() for p in engine.module.parameters()]


@pytest.mark.parametrize("kind, methods", [
    ("unfused", ["CheckOverflow.has_overflow_serial"]),
    ("fused", ["CheckOverflow.has_overflow_serial"]),
    ("zero1", ["DeepSpeedZeroOptimizer.has_overflow_serial",
               "DeepSpeedZeroOptimizer.has_overflow_partitioned_grads_serial",
               "DeepSpeedZeroOptimizer.get_grad_norm_direct"]),
    ("zero2", ["DeepSpeedZeroOptimizer.has_overflow_partitioned_grads_serial",
               "DeepSpeedZeroOptimizer.get_grad_norm_direct"]),
])
def test_deepspeed_optimizer_patched_matches_unpatched(deepspeed, monkeypatch, kind, methods):
    _, ref_trace, ref_params = _run_deepspeed(deepspeed, monkeypatch, kind, patch=False)
    opt, trace, params = _run_deepspeed(deepspeed, monkeypatch, kind, patch=True)
    expected_type = {"unfused": "FP16_UnfusedOptimizer", "fused": "FP16_Optimizer"}.get(kind, "DeepSpeedZeroOptimizer")
    assert type(opt).__name__ == expected_type and type(opt).__module__.startswith("deepspeed.")
    for m in methods:
        assert any(p.endswith(m) for p in opt._ort_dynamo_patched)
    assert opt._ort_dynamo_grad_stats.ort_runs >= 5 and opt._ort_dynamo_grad_stats.graphs_built == 1
    # The overflow at step 2 is seen (scale halves, hysteresis 1) exactly as DeepSpeed sees it.
    assert [t[0] for t in ref_trace] == [False, False, True, False, False]
    assert ref_trace[2][2] == ref_trace[1][2] / 2
    for (o, n, s), (ro, rn, rs) in zip(trace, ref_trace):
        assert o == ro and s == rs
        assert (n is None) == (rn is None)
        if n is not None and math.isfinite(rn):
            assert n == pytest.approx(rn, rel=1e-6)
        elif n is not None:
            assert not math.isfinite(n)
    for p, q in zip(params, ref_params):
        torch.testing.assert_close(p, q, rtol=1e-3, atol=1e-4)
