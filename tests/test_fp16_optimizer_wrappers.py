"""FP16_Optimizer on DeepSpeed's and apex's fp16 optimizers: their overflow checks, grad norms and
(apex O2) master-grad unscale in one ORT graph.

Tests that need DeepSpeed skip when it is not importable; they run it on the CPU accelerator
(``DS_ACCELERATOR=cpu``). The stand-in tests always run: they drive the replacements through
objects with the attributes DeepSpeed's methods read, or through apex amp's own O2 code copied
below (apex needs CUDA and is not installable here), and check the refusal paths. The real-apex
test skips without apex and a GPU.
"""

import contextlib
import hashlib
import math
import os
import sys
import types
import warnings

import pytest
import torch

from ort_dynamo.optim import FP16_Optimizer
from ort_dynamo.optim import _wrappers
from ort_dynamo.optim._wrappers import GradStats, fingerprint, tree_fingerprint
from parity import free_port

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
    # Something with amp's stash but no apex O2 _post_amp_backward: returned unchanged too.
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


def test_a_fingerprint_is_the_same_on_every_python():
    """The audited sources were hashed on Python 3.11; later parsers write some code as other
    trees (3.12: ``type_params=[]`` on every def, an empty string closing an f-string's format
    spec), so hashing ``ast.dump`` refused every audited method on 3.12."""
    import ast

    source = "def f(x, width):\n    y = ...\n    return f'{x:<{width}}', y\n"
    # sha256 of Python 3.11's ast.dump of ``source``, as KNOWN_SOURCES' hashes were taken.
    assert tree_fingerprint(ast.parse(source)) == "8a9e8d107ba641c5"
    if sys.version_info[:2] == (3, 11):
        assert hashlib.sha256(ast.dump(ast.parse(source)).encode()).hexdigest()[:16] == "8a9e8d107ba641c5"
    as_312 = ast.parse(source)
    spec = next(n for n in ast.walk(as_312) if isinstance(n, ast.FormattedValue) and n.format_spec).format_spec
    spec.values.append(ast.Constant(value=""))
    assert tree_fingerprint(as_312) == tree_fingerprint(ast.parse(source))
    assert tree_fingerprint(ast.parse(source.replace("...", "None"))) != tree_fingerprint(ast.parse(source))


# -- apex amp O2 stand-in ----------------------------------------------------------------------
# Copied from NVIDIA/apex (code kept as is, so its AST fingerprint is apex's): the functions from
# apex/amp/_process_optimizer.py at 00dbe4b440d7b0cbf7942672f0b1efde79031711 (its
# post_backward_with_master_weights is unchanged at f17401fc71f54f80df8350ca649d0c180d874c59), the
# LossScaler methods and helpers from apex/amp/scaler.py at b82c6bd7613ffb9c4ea68e7306fa83aabe9fa9b5,
# and the non-delayed path of scale_loss from apex/amp/handle.py at 007c59472a94c69683b9315ee6844bcde1b15997.
# Adapted for CPU (no amp_C, no torch.cuda.*Tensor): lazy init, __init__ and the kernel emulation.


def maybe_print(msg, rank0=False):
    pass


class _MultiTensorApplier:  # apex.multi_tensor_apply: op(noop_flag, tensor_lists, *args)
    available = False

    def __call__(self, op, noop_flag_buffer, tensor_lists, *args):
        return op(noop_flag_buffer, tensor_lists, *args)


multi_tensor_applier = _MultiTensorApplier()


def _amp_C_multi_tensor_scale(noop, lists, scale):
    # amp_C.multi_tensor_scale (csrc/multi_tensor_scale_kernel.cu): out = float(in) * scale,
    # written even when the input is not finite; the flag checks the inputs.
    for x, out in zip(*lists):
        out.copy_(x.float() * scale)
        if not torch.isfinite(x).all():
            noop.fill_(1)


def _amp_C_multi_tensor_axpby(noop, lists, a, b, arg_to_check):
    # amp_C.multi_tensor_axpby: out = a * float(x) + b * float(y); arg_to_check 0 checks x only.
    assert arg_to_check == 0
    for x, y, out in zip(*lists):
        out.copy_(x.float() * a + y.float() * b)
        if not torch.isfinite(x).all():
            noop.fill_(1)


def scale_check_overflow_python(model_grad, master_grad, scale, check_overflow=False):
    # Exception handling for 18.04 compatibility
    if check_overflow:
        cpu_sum = float(model_grad.float().sum())
        if cpu_sum == float('inf') or cpu_sum == -float('inf') or cpu_sum != cpu_sum:
            return True

    if master_grad is not model_grad: # copy_ probably internally short-circuits this
        master_grad.copy_(model_grad)
    if scale != 1.0:
        master_grad.mul_(scale)
    return False


def axpby_check_overflow_python(model_grad, stashed_grad, master_grad, scale, check_overflow=False):
    # Exception handling for 18.04 compatibility
    if check_overflow:
        cpu_sum = float(model_grad.float().sum())
        if cpu_sum == float('inf') or cpu_sum == -float('inf') or cpu_sum != cpu_sum:
            return True

    # if master_grad is not model_grad: # copy_ probably internally short-circuits this
    #     master_grad.copy_(model_grad)
    assert stashed_grad.dtype == master_grad.dtype
    converted_model_grad = model_grad.to(master_grad.dtype)
    stashed_grad.add_(scale, converted_model_grad)
    master_grad.data = stashed_grad.data
    return False


class LossScaler(object):
    warned_no_fused_kernel = False
    warned_unscaling_non_fp32_grad = False
    has_fused_kernel = False

    def __init__(self, loss_scale, init_scale=2.**16, scale_window=2000, min_loss_scale=None,
                 max_loss_scale=2.**24):
        # apex's, with a CPU overflow buffer and the kernels chosen by the test.
        if loss_scale == "dynamic":
            self.dynamic = True
            self._loss_scale = init_scale
        else:
            self.dynamic = False
            self._loss_scale = loss_scale
        self._max_loss_scale = max_loss_scale
        self._min_loss_scale = min_loss_scale
        self._scale_seq_len = scale_window
        self._unskipped = 0
        self._has_overflow = False
        self._overflow_buf = torch.zeros(1, dtype=torch.int32)

    def loss_scale(self):
        return self._loss_scale

    def unscale_python(self, model_grads, master_grads, scale):
        for model, master in zip(model_grads, master_grads):
            if model is not None:
                if not LossScaler.warned_unscaling_non_fp32_grad:
                    if master.dtype != torch.float32:
                        maybe_print(
                            "Attempting to unscale a grad with type {} ".format(master.type()) +
                            "Unscaling non-fp32 grads may indicate an error. "
                            "When using Amp, you don't need to call .half() on your model.")
                        LossScaler.warned_unscaling_non_fp32_grad = True
                self._has_overflow = scale_check_overflow_python(model,
                                                                 master,
                                                                 1./scale,
                                                                 self.dynamic)
                if self._has_overflow and self.dynamic:
                    break

    # unused_scale keeps some of the old API alive for hopefully a short time.
    def unscale(self, model_grads, master_grads, unused_scale, models_are_masters=False):
        if self._has_overflow:
            return

        scale = self._loss_scale

        if scale == 1.0 and models_are_masters and not self.dynamic:
            return

        if LossScaler.has_fused_kernel:
            # if (not LossScaler.warned_unscaling_non_fp32_grad
            #     and master_grads[0].dtype == torch.float16):
            #     print("Warning:  unscaling grads that are not FP32. "
            #           "Unscaling non-fp32 grads may indicate an error. "
            #           "When using Amp, you don't need to call .half() on your model.")
            #     # Setting this to True unconditionally allows the possibility of an escape
            #     # if never-before-seen non-fp32 grads are created in some later iteration.
            #     LossScaler.warned_unscaling_non_fp32_grad = True
            multi_tensor_applier(LossScaler.multi_tensor_scale_cuda,
                                 self._overflow_buf,
                                 [model_grads, master_grads],
                                 1./scale)
        else:
            self.unscale_python(model_grads, master_grads, scale)

        # Defer to update_scale
        # If the fused kernel is available, we only need one D2H memcopy and sync.
        # if LossScaler.has_fused_kernel and self.dynamic and not self._has_overflow:
        #     self._has_overflow = self._overflow_buf.item()

    def unscale_with_stashed_python(self,
                                    model_grads,
                                    stashed_master_grads,
                                    master_grads,
                                    scale):
        for model, stashed, master in zip(model_grads, stashed_master_grads, master_grads):
            if model is None and stashed is None:
                continue
            else:
                if not LossScaler.warned_unscaling_non_fp32_grad:
                    if master.dtype != torch.float32:
                        maybe_print(
                            "Attempting to unscale a grad with type {} ".format(master.type()) +
                            "Unscaling non-fp32 grads may indicate an error. "
                            "When using Amp, you don't need to call .half() on your model.")
                        LossScaler.warned_unscaling_non_fp32_grad = True
                self._has_overflow = axpby_check_overflow_python(model,
                                                                 stashed,
                                                                 master,
                                                                 1./scale,
                                                                 self.dynamic)
                if self._has_overflow and self.dynamic:
                    break

    def unscale_with_stashed(self,
                             model_grads,
                             stashed_master_grads,
                             master_grads):
        if self._has_overflow:
            return

        scale = self._loss_scale

        if LossScaler.has_fused_kernel:
            if (not LossScaler.warned_unscaling_non_fp32_grad
                and master_grads[0].dtype == torch.float16):
                print("Warning:  unscaling grads that are not FP32. "
                      "Unscaling non-fp32 grads may indicate an error. "
                      "When using Amp, you don't need to call .half() on your model.")
                # Setting this to True unconditionally allows the possibility of an escape
                # if never-before-seen non-fp32 grads are created in some later iteration.
                LossScaler.warned_unscaling_non_fp32_grad = True
            multi_tensor_applier(LossScaler.multi_tensor_axpby_cuda,
                                 self._overflow_buf,
                                 [model_grads, stashed_master_grads, master_grads],
                                 1./scale,
                                 1.0,
                                 0) # check only arg 0, aka the incoming model grads, for infs
        else:
            self.unscale_with_stashed_python(model_grads,
                                             stashed_master_grads,
                                             master_grads,
                                             scale)

        # Defer to update_scale
        # If the fused kernel is available, we only need one D2H memcopy and sync.
        # if LossScaler.has_fused_kernel and self.dynamic and not self._has_overflow:
        #     self._has_overflow = self._overflow_buf.item()

    def clear_overflow_state(self):
        self._has_overflow = False
        if self.has_fused_kernel:
            self._overflow_buf.zero_()

    # Separate so unscale() can be called more that once before updating.
    def update_scale(self):
        # If the fused kernel is available, we only need one D2H memcopy and sync.
        if LossScaler.has_fused_kernel and self.dynamic and not self._has_overflow:
            self._has_overflow = self._overflow_buf.item()

        if self._has_overflow and self.dynamic:
            should_skip = True
            if(self._min_loss_scale):
                self._loss_scale = max(self._min_loss_scale, self._loss_scale/2.)
            else:
                self._loss_scale = self._loss_scale/2.
            self._unskipped = 0
        else:
            should_skip = False
            self._unskipped += 1

        if self._unskipped == self._scale_seq_len and self.dynamic:
            self._loss_scale = min(self._max_loss_scale, self._loss_scale*2.)
            self._unskipped = 0

        return should_skip


LossScaler.multi_tensor_scale_cuda = _amp_C_multi_tensor_scale
LossScaler.multi_tensor_axpby_cuda = _amp_C_multi_tensor_axpby


def post_backward_models_are_masters(scaler, params, stashed_grads):
        # This is a lot of python overhead...
        grads_needing_unscale = []
        grads_needing_unscale_with_stash = []
        stashed = []
        for param, stashed_grad in zip(params, stashed_grads):
            if param.grad is None and stashed_grad is not None:
                param.grad = stashed_grad
            elif param.grad is not None and stashed_grad is None:
                grads_needing_unscale.append(param.grad)
            elif param.grad is not None and stashed_grad is not None:
                grads_needing_unscale_with_stash.append(param.grad)
                stashed.append(stashed_grad)
            else: # param.grad is None and stashed_grad is None
                continue

        if len(grads_needing_unscale) > 0:
            scaler.unscale(
                grads_needing_unscale,
                grads_needing_unscale,
                scaler.loss_scale(),
                models_are_masters=True)

        if len(grads_needing_unscale_with_stash) > 0:
            scaler.unscale_with_stashed(
                grads_needing_unscale_with_stash,
                stashed,
                grads_needing_unscale_with_stash)

        # Clear the stash.
        for i in range(len(stashed_grads)):
            stashed_grads[i] = None


def prepare_backward_with_master_weights(self):
    stash = self._amp_stash

    self._amp_lazy_init()

    for i, param in enumerate(stash.all_fp16_params):
        # Set up to leverage grad copy elision:
        param.grad = None

    # for i, param in enumerate(stash.all_fp32_from_fp16_params):
    #     stash.all_fp32_from_fp16_grad_stash[i] = param.grad

    for i, param in enumerate(stash.all_fp32_from_fp32_params):
        stash.all_fp32_from_fp32_grad_stash[i] = param.grad
        # Set up to leverage grad copy elision:
        param.grad = None


def post_backward_with_master_weights(self, scaler):
    stash = self._amp_stash

    self._amp_lazy_init()

    # This is a lot of python overhead...
    fp16_grads_needing_unscale = []
    new_fp32_grads = []
    fp16_grads_needing_unscale_with_stash = []
    preexisting_fp32_grads = []
    for fp16_param, fp32_param in zip(stash.all_fp16_params,
                                      stash.all_fp32_from_fp16_params):
        if fp16_param.grad is None and fp32_param.grad is not None:
            continue
        elif fp16_param.grad is not None and fp32_param.grad is None:
            fp32_param.grad = torch.empty_like(fp32_param)
            fp16_grads_needing_unscale.append(fp16_param.grad)
            new_fp32_grads.append(fp32_param.grad)
        elif fp16_param.grad is not None and fp32_param.grad is not None:
            fp16_grads_needing_unscale_with_stash.append(fp16_param.grad)
            preexisting_fp32_grads.append(fp32_param.grad)
        else: # fp16_param.grad is None and fp32_param.grad is None:
            continue

    if len(fp16_grads_needing_unscale) > 0:
        scaler.unscale(
            fp16_grads_needing_unscale,
            new_fp32_grads,
            scaler.loss_scale(),
            models_are_masters=False)

    if len(fp16_grads_needing_unscale_with_stash) > 0:
        scaler.unscale_with_stashed(
            fp16_grads_needing_unscale_with_stash,
            preexisting_fp32_grads,
            preexisting_fp32_grads)

    # fp32 params can be treated as they would be in the "no_master_weights" case.
    post_backward_models_are_masters(
        scaler,
        stash.all_fp32_from_fp32_params,
        stash.all_fp32_from_fp32_grad_stash)


def post_backward_no_master_weights(self, scaler):
    stash = self._amp_stash

    self._amp_lazy_init()

    split_types = ((stash.all_fp16_params, stash.all_fp16_grad_stash),
             (stash.all_fp32_params, stash.all_fp32_grad_stash))

    for params, stashed_grads in split_types:
        post_backward_models_are_masters(scaler, params, stashed_grads)


def _amp_process_optimizer(optimizer, post_amp_backward=post_backward_with_master_weights):
    """What apex's _process_optimizer does for master_weights=True (O2) and a torch optimizer
    (apex/amp/_process_optimizer.py at f17401fc: stash, lazy init, step and zero_grad wrappers)."""
    stash = optimizer._amp_stash = types.SimpleNamespace(lazy_init_called=False, already_patched=False,
                                                         params_have_scaled_gradients=False)

    def lazy_init_with_master_weights(self):  # apex's, classifying by dtype instead of cuda type()
        stash.fp16_groups, stash.fp32_from_fp16_groups, stash.fp32_from_fp32_groups = [], [], []
        for group in self.param_groups:
            fp16, fp32, masters = [], [], []
            for i, param in enumerate(group["params"]):
                if param.dtype == torch.float16:
                    fp16.append(param)
                    master = param.detach().clone().float()
                    master.requires_grad = True
                    group["params"][i] = master
                    masters.append(master)
                else:
                    fp32.append(param)
            stash.fp16_groups.append(fp16)
            stash.fp32_from_fp16_groups.append(masters)
            stash.fp32_from_fp32_groups.append(fp32)
        stash.all_fp16_params = [p for g in stash.fp16_groups for p in g]
        stash.all_fp32_from_fp16_params = [p for g in stash.fp32_from_fp16_groups for p in g]
        stash.all_fp32_from_fp32_params = [p for g in stash.fp32_from_fp32_groups for p in g]
        stash.all_fp16_grad_stash = [None for _ in stash.all_fp16_params]
        stash.all_fp32_from_fp32_grad_stash = [None for _ in stash.all_fp32_from_fp32_params]
        for param in stash.all_fp32_from_fp16_params + stash.all_fp32_from_fp32_params:
            param.grad = None
        self.load_state_dict(self.state_dict())

    def _amp_lazy_init(self):
        if not stash.lazy_init_called:
            self._lazy_init_maybe_master_weights()
            stash.lazy_init_called = True

    old_step = optimizer.step

    def new_step(self, closure=None):
        retval = old_step()
        for model, master in zip(stash.all_fp16_params, stash.all_fp32_from_fp16_params):
            model.data.copy_(master.data)  # master_params_to_model_params
        for param in stash.all_fp32_from_fp16_params:
            param.grad = None
        return retval

    def new_zero_grad(self):
        self._amp_lazy_init()
        for param in stash.all_fp16_params + stash.all_fp32_from_fp32_params:
            if param.grad is not None:
                param.grad.detach_()
                param.grad.zero_()
        for param in stash.all_fp32_from_fp16_params:
            param.grad = None

    for name, fn in (("_lazy_init_maybe_master_weights", lazy_init_with_master_weights),
                     ("_amp_lazy_init", _amp_lazy_init), ("step", new_step), ("zero_grad", new_zero_grad),
                     ("_prepare_amp_backward", prepare_backward_with_master_weights),
                     ("_post_amp_backward", post_amp_backward)):
        setattr(optimizer, name, types.MethodType(fn, optimizer))
    return optimizer


@contextlib.contextmanager
def _scale_loss(loss, optimizer, loss_scaler):
    """apex.amp.scale_loss (handle.py at 007c594), one optimizer, delay_unscale=False."""
    if not optimizer._amp_stash.params_have_scaled_gradients:
        optimizer._prepare_amp_backward()
    yield loss.float() * loss_scaler.loss_scale()
    loss_scaler.clear_overflow_state()
    optimizer._post_amp_backward(loss_scaler)
    optimizer._amp_stash.params_have_scaled_gradients = False
    should_skip = loss_scaler.update_scale()
    if should_skip and not optimizer._amp_stash.already_patched:
        opt_step = optimizer.step

        def skip_step(closure=None):
            for param in optimizer._amp_stash.all_fp32_from_fp16_params:
                param.grad = None
            optimizer.step = opt_step
            optimizer._amp_stash.already_patched = False
        optimizer.step = skip_step
        optimizer._amp_stash.already_patched = True


def _run_apex_standin(patch, fused, loss_scale="dynamic", steps=5, scaler_cls=None):
    torch.manual_seed(0)
    w16 = [torch.nn.Parameter(torch.randn(33, 7).half()), torch.nn.Parameter(torch.randn(5).half())]
    w32 = torch.nn.Parameter(torch.randn(4))
    opt = _amp_process_optimizer(torch.optim.SGD(w16 + [w32], lr=0.1, momentum=0.9))
    scaler = (scaler_cls or LossScaler)(loss_scale, init_scale=2.0 ** 10)
    if patch:
        assert FP16_Optimizer(opt) is opt
    trace = []
    for step in range(steps):
        opt.zero_grad()
        for micro in range(2):  # two backward passes per step: the second accumulates into master grads
            g = torch.Generator().manual_seed(10 * step + micro)
            xs = [torch.randn(w.shape, generator=g) for w in w16]
            if step == 2 and micro == 0:
                xs[0][3, 1] = 1e4  # (w - x) * scale overflows fp16
            loss = sum(((w.float() - x) ** 2).sum() / 2 for w, x in zip(w16, xs)) + (w32 * xs[1][:4]).sum()
            with _scale_loss(loss, opt, scaler) as scaled:
                scaled.backward()
            masters = [p.grad.clone() for p in opt._amp_stash.all_fp32_from_fp16_params]
            trace.append((bool(scaler._has_overflow), scaler.loss_scale(), opt._amp_stash.already_patched,
                          masters, w32.grad.clone()))
        opt.step()
    return opt, trace, [p.detach().clone() for p in w16 + [w32]]


@pytest.mark.filterwarnings("ignore:This overload of add_ is deprecated")
@pytest.mark.parametrize("fused, loss_scale", [(False, "dynamic"), (True, "dynamic"), (False, 256.0)])
def test_apex_o2_post_backward_patched_matches_apex(monkeypatch, fused, loss_scale):
    # fused: apex's path with its amp_C kernels (emulated); else its Python fallback.
    monkeypatch.setattr(LossScaler, "has_fused_kernel", fused)
    _, ref_trace, ref_params = _run_apex_standin(False, fused, loss_scale)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # the audited sources: patched, no warning
        warnings.filterwarnings("ignore", "This overload of add_ is deprecated")  # apex's own add_(scale, g)
        opt, trace, params = _run_apex_standin(True, fused, loss_scale)
    assert opt._ort_dynamo_patched == ("apex.amp._process_optimizer.post_backward_with_master_weights",)
    stats = opt._ort_dynamo_grad_stats
    assert stats.ort_runs == 10 and stats.graphs_built == 2  # first backward: new master grads, then accumulate
    overflows = [t[0] for t in ref_trace]
    if loss_scale == "dynamic":
        assert overflows == [False] * 4 + [True] + [False] * 5
        assert ref_trace[4][1] == ref_trace[3][1] / 2 and ref_trace[4][2]  # scale halved, step skipped
    else:
        assert not any(overflows)  # static scaling does not check: the inf reaches the weights
        assert not torch.isfinite(ref_params[0]).all()
    for i, ((o, s, skip, masters, g32), (ro, rs, rskip, rmasters, rg32)) in enumerate(zip(trace, ref_trace)):
        assert (o, s, skip) == (ro, rs, rskip), i
        torch.testing.assert_close(g32, rg32, rtol=0, atol=0, equal_nan=True)
        if fused or not skip:  # apex's Python fallback stops at the first inf, leaving garbage master grads
            for m, rm in zip(masters, rmasters):
                torch.testing.assert_close(m, rm, rtol=0, atol=0, equal_nan=True)
    for p, q in zip(params, ref_params):
        torch.testing.assert_close(p, q, rtol=0, atol=0, equal_nan=True)


class _EditedLossScaler(LossScaler):
    def update_scale(self):  # a scaler whose source is not apex's: the patch steps aside
        return super().update_scale()


@pytest.mark.filterwarnings("ignore:This overload of add_ is deprecated")
def test_apex_other_paths_and_sources_are_left_to_apex():
    # O1 (no master weights) or another apex revision: _post_amp_backward is not replaced.
    opt = _amp_process_optimizer(torch.optim.SGD([torch.nn.Parameter(torch.ones(2).half())], lr=1),
                                 post_backward_no_master_weights)
    with pytest.warns(UserWarning, match="only apex O2's post_backward_with_master_weights"):
        assert FP16_Optimizer(opt) is opt
    assert opt._ort_dynamo_patched == () and opt._post_amp_backward.__func__ is post_backward_no_master_weights
    with pytest.raises(TypeError, match="takes no options"):
        FP16_Optimizer(opt, max_grad_norm=1.0)
    # An unaudited loss scaler is found at the first backward: apex's own method runs, same results.
    _, ref_trace, ref_params = _run_apex_standin(False, False, steps=3)
    with pytest.warns(UserWarning, match="_EditedLossScaler.update_scale"):
        opt, trace, params = _run_apex_standin(True, False, steps=3, scaler_cls=_EditedLossScaler)
    assert opt._ort_dynamo_grad_stats.ort_runs == 0
    assert [t[:3] for t in trace] == [t[:3] for t in ref_trace]
    for p, q in zip(params, ref_params):
        assert torch.equal(p, q)


# -- real DeepSpeed (CPU accelerator) ---------------------------------------------------------

@pytest.fixture(scope="module")
def deepspeed():
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    ds = pytest.importorskip("deepspeed")
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(free_port())), ("RANK", "0"),
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


# -- real apex (needs a CUDA build of apex and a GPU) ------------------------------------------

def _run_real_apex(amp, patch, fused_kernel, steps=5):
    from apex.amp.scaler import LossScaler as ApexLossScaler
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = amp.initialize(model, opt, opt_level="O2", loss_scale="dynamic", verbosity=0)
    if patch:
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            assert FP16_Optimizer(opt) is opt
        assert opt._ort_dynamo_patched == ("apex.amp._process_optimizer.post_backward_with_master_weights",)
    assert ApexLossScaler.has_fused_kernel == fused_kernel
    trace = []
    for step in range(steps):
        opt.zero_grad()
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 16, generator=g).cuda(), torch.randn(8, 4, generator=g).cuda()
        loss = torch.nn.functional.mse_loss(model(x.half()).float(), y)
        with amp.scale_loss(loss * 1e6 if step == 2 else loss, opt) as scaled:  # step 2: fp16 grads overflow
            scaled.backward()
        masters = [p.grad.clone() for p in opt._amp_stash.all_fp32_from_fp16_params]
        trace.append((opt._amp_stash.already_patched, amp._amp_state.loss_scalers[0].loss_scale(), masters))
        opt.step()
    return trace, [p.detach().clone() for p in model.parameters()]


def test_real_apex_o2_patched_matches_unpatched():
    amp = pytest.importorskip("apex.amp")
    if not torch.cuda.is_available():
        pytest.skip("apex amp needs CUDA")
    from apex.multi_tensor_apply import multi_tensor_applier
    fused = multi_tensor_applier.available
    ref_trace, ref_params = _run_real_apex(amp, False, fused)
    trace, params = _run_real_apex(amp, True, fused)
    assert [t[0] for t in ref_trace] == [False, False, True, False, False]
    for i, ((skip, scale, masters), (rskip, rscale, rmasters)) in enumerate(zip(trace, ref_trace)):
        assert (skip, scale) == (rskip, rscale), i
        if fused or not skip:
            for m, rm in zip(masters, rmasters):
                torch.testing.assert_close(m, rm, rtol=0, atol=0, equal_nan=True)
    for p, q in zip(params, ref_params):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
