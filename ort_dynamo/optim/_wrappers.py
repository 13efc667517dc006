"""``FP16_Optimizer`` on DeepSpeed's (and apex's) own fp16 optimizers: patch, don't wrap.

As onnxruntime-training did, DeepSpeed stays in charge of loss scaling, clipping and the step;
only its per-tensor overflow checks and gradient L2 norms are replaced by one ONNX Runtime
graph over all gradients (``_graphs.grad_stats_model``). A method is replaced only when its
source (as an AST, so comments and formatting do not matter) is one we audited and matched our
replacement against; any other version keeps DeepSpeed's method and a warning says so.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import textwrap
import types
import warnings
from typing import Any, Callable, Sequence

import torch

from ._graphs import grad_stats_model
from ._session import BoundSession, input_names, onnx_type

__all__ = ["GradStats", "fingerprint", "patch_external_optimizer", "KNOWN_SOURCES"]

ZERO_1_2 = "deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer"
DS_FUSED = "deepspeed.runtime.fp16.fused_optimizer.FP16_Optimizer"
DS_UNFUSED = "deepspeed.runtime.fp16.unfused_optimizer.FP16_UnfusedOptimizer"
CHECK_OVERFLOW = "deepspeed.runtime.utils.CheckOverflow"

# method qualname -> {AST fingerprint: DeepSpeed versions it was read from}. Add a version only
# after checking that the method's contract (arguments, return type and value) is unchanged.
KNOWN_SOURCES: dict[str, dict[str, str]] = {
    f"{ZERO_1_2}.has_overflow_serial": {"69a3abb3ac11eec9": "0.19.8"},
    f"{ZERO_1_2}.has_overflow_partitioned_grads_serial": {"6e4825024ce1332f": "0.19.8"},
    f"{ZERO_1_2}.get_grad_norm_direct": {"a042bb54a24d06cf": "0.19.8"},
    f"{CHECK_OVERFLOW}.has_overflow_serial": {"e1fd6729543528ee": "0.19.8"},
}


def fingerprint(fn: Callable) -> str | None:
    """Hash of a function's AST without docstrings; None when its source is unavailable."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return None
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return hashlib.sha256(ast.dump(tree).encode()).hexdigest()[:16]


class GradStats:
    """Sum of squares (float64) and all-finite flag of a list of gradients: one ORT run per device."""

    def __init__(self) -> None:
        self._sessions: dict[tuple, BoundSession] = {}
        self._outs: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self.ort_runs = 0
        self.graphs_built = 0

    @staticmethod
    def supports(grads: Sequence[torch.Tensor]) -> bool:
        return all(not g.is_sparse and g.layout == torch.strided and g.dtype in _FLOAT_TYPES for g in grads)

    def __call__(self, grads: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(sumsq, found_inf)``: 0-d float64 and bool tensors on the first grad's device."""
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for g in grads:
            if g.numel():
                by_device.setdefault(g.device, []).append(g if g.is_contiguous() else g.contiguous())
        if not by_device:
            device = grads[0].device if grads else torch.device("cpu")
            return (torch.zeros((), dtype=torch.float64, device=device),
                    torch.zeros((), dtype=torch.bool, device=device))
        results = [self._run(device, gs) for device, gs in by_device.items()]
        first = grads[0].device
        sumsq = sum(s.to(first) for s, _ in results)
        found = results[0][1].to(first)
        for _, f in results[1:]:
            found = found | f.to(first)
        return sumsq, found

    def _run(self, device: torch.device, grads: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
        key = (device, stream, tuple((g.numel(), g.dtype) for g in grads))
        session = self._sessions.get(key)
        if session is None:
            model = grad_stats_model([g.numel() for g in grads], [onnx_type(g.dtype) for g in grads])
            session = self._sessions[key] = BoundSession(model, device)
            self.graphs_built += 1
        outs = self._outs.get(device)
        if outs is None:
            outs = self._outs[device] = (torch.zeros((), dtype=torch.float64, device=device),
                                         torch.zeros((), dtype=torch.bool, device=device))
        session.bind(input_names("g", len(grads)), grads, output=False)
        session.bind(("sumsq", "found_inf"), outs, output=True)
        session.run()
        self.ort_runs += 1
        # Copies: the output buffers are rewritten by the next run.
        return outs[0].clone(), outs[1].clone()


_FLOAT_TYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


# -- replacements ------------------------------------------------------------------------------
# Each one returns what the audited DeepSpeed method returns (same type, device and value up to
# float rounding of the norm) and calls the original for inputs it does not handle.

def _zero_has_overflow_serial(orig: Callable, stats: GradStats) -> Callable:
    accel = orig.__globals__["get_accelerator"]

    def has_overflow_serial(self, params):
        params = list(params)
        grads = [p.grad for p in params if p.grad is not None]
        if not GradStats.supports(grads):
            return orig(self, params)
        # DeepSpeed: a [1] bool tensor on the accelerator (count of grads with inf/NaN > 0).
        return stats(grads)[1].reshape(1).to(accel().current_device_name())
    return has_overflow_serial


def _zero_has_overflow_partitioned_grads_serial(orig: Callable, stats: GradStats) -> Callable:
    accel = orig.__globals__["get_accelerator"]

    def has_overflow_partitioned_grads_serial(self):
        grads = [g for i in range(len(self.bit16_groups)) for g in self.averaged_gradients[i] if g is not None]
        if not GradStats.supports(grads):
            return orig(self)
        return stats(grads)[1].reshape(1).to(accel().current_device_name())
    return has_overflow_partitioned_grads_serial


def _zero_get_grad_norm_direct(orig: Callable, stats: GradStats) -> Callable:
    g_ = orig.__globals__
    pipe_replicated, is_mp_param = g_["PIPE_REPLICATED"], g_["is_model_parallel_parameter"]
    accel, dist, mask = g_["get_accelerator"], g_["dist"], g_["mask_nan_or_inf_with_val_inplace"]

    def get_grad_norm_direct(self, gradients, params, norm_type=2):
        if float(norm_type) != 2.0:
            return orig(self, gradients, params, norm_type)
        gradients, params = list(gradients), list(params)
        selected = []
        # The same selection as DeepSpeed: no padding, no pipeline replicas, model-parallel
        # duplicates only on model-parallel rank 0.
        for g, p in zip((g for g in gradients if not getattr(g, "_zero_padding", False)), params):
            if hasattr(p, pipe_replicated) and p.ds_pipe_replicated:
                continue
            if is_mp_param(p) or self.model_parallel_rank == 0:
                selected.append(g.data)
        if not GradStats.supports(selected):
            return orig(self, gradients, params, norm_type)
        if selected:
            total_norm = stats(selected)[0].to(accel().current_device_name()).float()
        else:
            total_norm = torch.tensor(0.0, dtype=torch.float32).to(self.device)
        dist.all_reduce(total_norm, op=dist.ReduceOp.SUM, group=self.dp_process_group)
        self._model_parallel_all_reduce(tensor=total_norm, op=dist.ReduceOp.SUM)
        total_norm = total_norm.pow(0.5)
        mask(total_norm, device=self.device)  # inf/NaN -> -1, DeepSpeed's "invalid norm"
        return total_norm
    return get_grad_norm_direct


def _check_overflow_has_overflow_serial(orig: Callable, stats: GradStats) -> Callable:
    def has_overflow_serial(self, params):
        params = list(params)
        grads = [p.grad.data for p in params if p.grad is not None]
        if not GradStats.supports(grads):
            return orig(self, params)
        return bool(stats(grads)[1])
    return has_overflow_serial


# -- patching --------------------------------------------------------------------------------

def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _class_names(obj: Any) -> list[str]:
    return [_qualname(c) for c in type(obj).__mro__]


def _patch(target: Any, cls_name: str, method: str, make: Callable, stats: GradStats,
           patched: list[str], refused: list[str]) -> None:
    orig = getattr(type(target), method, None)
    name = f"{cls_name}.{method}"
    fp = fingerprint(orig) if callable(orig) else None
    if fp is None or fp not in KNOWN_SOURCES.get(name, {}):
        refused.append(f"{name} (fingerprint {fp})")
        return
    setattr(target, method, types.MethodType(make(orig, stats), target))
    patched.append(name)


def _deepspeed_version() -> str:
    try:
        import deepspeed
        return str(deepspeed.__version__)
    except Exception:  # noqa: BLE001 (any import failure: just no version in the message)
        return "unknown"


def patch_external_optimizer(optimizer: Any, options: Sequence[str] = ()) -> Any | None:
    """Patch a DeepSpeed/apex fp16 optimizer in place and return it; None if it is neither."""
    names = _class_names(optimizer)
    is_apex = hasattr(optimizer, "_amp_stash")
    is_deepspeed = any(n.startswith("deepspeed.") for n in names)
    if not (is_apex or is_deepspeed):
        return None
    if options:
        raise TypeError(f"FP16_Optimizer({type(optimizer).__name__}) takes no options ({list(options)}): "
                        "DeepSpeed/apex keep loss scaling and clipping, configure them there")
    if isinstance(optimizer, torch.nn.Module):
        raise TypeError(f"FP16_Optimizer got the DeepSpeed engine ({names[0]}); pass the optimizer that "
                        "deepspeed.initialize returns (engine.optimizer)")
    if getattr(optimizer, "_ort_dynamo_patched", None) is not None:
        return optimizer
    patched: list[str] = []
    refused: list[str] = []
    stats = GradStats()
    if is_apex:
        warnings.warn("FP16_Optimizer: apex amp optimizers are returned unchanged (ort_dynamo does not "
                      "patch apex; its own kernels keep running)", UserWarning, stacklevel=3)
    elif ZERO_1_2 in names:
        for method, make in (("has_overflow_serial", _zero_has_overflow_serial),
                             ("has_overflow_partitioned_grads_serial", _zero_has_overflow_partitioned_grads_serial),
                             ("get_grad_norm_direct", _zero_get_grad_norm_direct)):
            _patch(optimizer, ZERO_1_2, method, make, stats, patched, refused)
    elif DS_FUSED in names or DS_UNFUSED in names:
        checker = getattr(optimizer, "overflow_checker", None)
        if checker is not None and CHECK_OVERFLOW in _class_names(checker):
            _patch(checker, CHECK_OVERFLOW, "has_overflow_serial", _check_overflow_has_overflow_serial,
                   stats, patched, refused)
        else:
            refused.append(f"{names[0]}.overflow_checker (not a {CHECK_OVERFLOW})")
    else:
        warnings.warn(f"FP16_Optimizer: {names[0]} is returned unchanged (ort_dynamo patches "
                      f"{ZERO_1_2}, {DS_FUSED} and {DS_UNFUSED})", UserWarning, stacklevel=3)
    if refused:
        warnings.warn(f"FP16_Optimizer: DeepSpeed {_deepspeed_version()} has methods whose source differs "
                      f"from the versions ort_dynamo checked, so they are left as they are: {refused}",
                      UserWarning, stacklevel=3)
    optimizer._ort_dynamo_patched = tuple(patched)
    optimizer._ort_dynamo_grad_stats = stats
    return optimizer
