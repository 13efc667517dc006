"""``FP16_Optimizer`` on DeepSpeed's and apex's own fp16 optimizers: patch, don't wrap.

As onnxruntime-training did, DeepSpeed stays in charge of loss scaling, clipping and the step;
only its per-tensor overflow checks and gradient L2 norms are replaced by one ONNX Runtime
graph over all gradients (``_graphs.grad_stats_model``). For apex amp (O2, master weights) the
unscale of fp16 model grads into fp32 master grads with its overflow check is one ORT graph
(``_graphs.apex_unscale_model``); apex keeps its loss scaler and the step. A method is
replaced only when its source (as an AST, so comments and formatting do not matter) is one we
audited and matched our replacement against; any other version keeps the library's method and
a warning says so.
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

from ..run import compute_stream
from ._graphs import apex_unscale_model, grad_stats_model
from ._session import BoundSession, input_names, onnx_type

__all__ = ["ApexUnscale", "GradStats", "fingerprint", "tree_fingerprint", "patch_external_optimizer", "KNOWN_SOURCES"]

ZERO_1_2 = "deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer"
DS_FUSED = "deepspeed.runtime.fp16.fused_optimizer.FP16_Optimizer"
DS_UNFUSED = "deepspeed.runtime.fp16.unfused_optimizer.FP16_UnfusedOptimizer"
CHECK_OVERFLOW = "deepspeed.runtime.utils.CheckOverflow"
APEX_PROCESS = "apex.amp._process_optimizer"
APEX_SCALER = "apex.amp.scaler"

# method qualname -> {AST fingerprint: DeepSpeed versions it was read from}. Add a version only
# after checking that the method's contract (arguments, return type and value) is unchanged.
KNOWN_SOURCES: dict[str, dict[str, str]] = {
    f"{ZERO_1_2}.has_overflow_serial": {"69a3abb3ac11eec9": "0.19.8"},
    f"{ZERO_1_2}.has_overflow_partitioned_grads_serial": {"6e4825024ce1332f": "0.19.8"},
    f"{ZERO_1_2}.get_grad_norm_direct": {"a042bb54a24d06cf": "0.19.8"},
    f"{CHECK_OVERFLOW}.has_overflow_serial": {"e1fd6729543528ee": "0.19.8"},
    # apex (NVIDIA/apex commits): the O2 method replaced, then the scaler code it stands in for.
    # "scale_override" is the later LossScaler API (read from vendored copies of apex; the same
    # maths when no override is passed, as post_backward_with_master_weights does).
    f"{APEX_PROCESS}.post_backward_with_master_weights": {"9078ecb64bbb4973": "00dbe4b, f17401f"},
    f"{APEX_SCALER}.LossScaler.unscale": {"e90b2dc0cd9fd0ea": "b82c6bd", "5de039e596c017ca": "scale_override"},
    f"{APEX_SCALER}.LossScaler.unscale_with_stashed": {"b42fd18338aff248": "b82c6bd",
                                                       "c54f15ec84fdeb64": "scale_override"},
    f"{APEX_SCALER}.LossScaler.unscale_python": {"19815b867ea2da3a": "b82c6bd"},
    f"{APEX_SCALER}.LossScaler.unscale_with_stashed_python": {"0d04b0ca03e9c691": "b82c6bd",
                                                              "1208f88525bbccb1": "scale_override"},
    f"{APEX_SCALER}.LossScaler.update_scale": {"adb37bcee105834e": "b82c6bd"},
    f"{APEX_SCALER}.scale_check_overflow_python": {"bcc2b7909a4045d6": "b82c6bd"},
    f"{APEX_SCALER}.axpby_check_overflow_python": {"e891649abf0c05c3": "b82c6bd", "1fc26e248594e0b3": "scale_override"},
}


def fingerprint(fn: Callable) -> str | None:
    """Hash of a function's AST without docstrings; None when its source is unavailable."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return None
    return tree_fingerprint(tree)


def tree_fingerprint(tree: ast.AST) -> str:
    """Hash of ``tree`` without docstrings, the same on every Python (see ``_dump``)."""
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return hashlib.sha256(_dump(tree).encode()).hexdigest()[:16]


_MISSING = object()


def _dump(node: Any) -> str:
    """``ast.dump(node)`` as Python 3.11 writes it (``KNOWN_SOURCES`` were hashed so), on any
    Python: without 3.12's ``type_params``, and without the empty string 3.12 parses at the end
    of an f-string's format spec. (``ast.dump`` itself differs by version; 3.13 also leaves out
    empty lists.)"""
    if isinstance(node, ast.AST):
        cls, fields = type(node), []
        for name in node._fields:
            value = getattr(node, name, _MISSING)
            if name == "type_params" or value is _MISSING or (value is None and getattr(cls, name, _MISSING) is None):
                continue
            if isinstance(node, ast.JoinedStr):
                value = [v for v in value if not (isinstance(v, ast.Constant) and v.value == "")]
            fields.append(f"{name}={_dump(value)}")
        return f"{cls.__name__}({', '.join(fields)})"
    if isinstance(node, list):
        return f"[{', '.join(_dump(item) for item in node)}]"
    return repr(node)


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
        stream = compute_stream(device)
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


class ApexUnscale:
    """apex O2's fp16 -> fp32 master-grad unscale and its overflow check: one ORT run per device."""

    def __init__(self) -> None:
        self._sessions: dict[tuple, BoundSession] = {}
        self._bufs: dict[torch.device, tuple[float, torch.Tensor, torch.Tensor]] = {}
        self.ort_runs = 0
        self.graphs_built = 0

    @staticmethod
    def supports(model_grads: Sequence[torch.Tensor], masters: Sequence[torch.Tensor]) -> bool:
        # What apex's CUDA kernels take: dense contiguous fp16 model grads, fp32 masters alike.
        pairs = list(zip(model_grads, masters))
        return all(g.dtype == torch.float16 and m.dtype == torch.float32 and g.layout == m.layout == torch.strided
                   and g.is_contiguous() and m.is_contiguous() and g.numel() == m.numel() and g.device == m.device
                   and g.device == pairs[0][0].device for g, m in pairs)

    def __call__(self, new_grads: Sequence[torch.Tensor], new_masters: Sequence[torch.Tensor],
                 stash_grads: Sequence[torch.Tensor], stash_masters: Sequence[torch.Tensor],
                 loss_scale: float) -> torch.Tensor | None:
        """``new_masters[i] = float(new_grads[i]) / loss_scale`` and, in place,
        ``stash_masters[j] += float(stash_grads[j]) / loss_scale``; returns the 0-d bool "some model
        grad is inf/NaN" (None when all tensors are empty)."""
        new = [(g, m) for g, m in zip(new_grads, new_masters) if g.numel()]
        old = [(g, m) for g, m in zip(stash_grads, stash_masters) if g.numel()]
        if not (new or old):
            return None
        device = (new or old)[0][0].device
        stream = compute_stream(device)
        key = (device, stream, tuple(g.numel() for g, _ in new), tuple(g.numel() for g, _ in old))
        session = self._sessions.get(key)
        if session is None:
            model = apex_unscale_model([g.numel() for g, _ in new], [g.numel() for g, _ in old])
            session = self._sessions[key] = BoundSession(model, device)
            self.graphs_built += 1
        # apex passes 1./scale (a Python float) to its kernels as a C float: the same rounding.
        inv = 1.0 / loss_scale
        bufs = self._bufs.get(device)
        if bufs is None or bufs[0] != inv:
            found = bufs[2] if bufs else torch.zeros((), dtype=torch.bool, device=device)
            bufs = self._bufs[device] = (inv, torch.tensor(inv, dtype=torch.float32, device=device), found)
        session.bind(("inv_scale",), (bufs[1],), output=False)
        session.bind(("found_inf",), (bufs[2],), output=True)
        if new:
            session.bind(input_names("a", len(new)), [g for g, _ in new], output=False)
            session.bind(input_names("o", len(new)), [m for _, m in new], output=True)
        if old:
            session.bind(input_names("b", len(old)), [g for g, _ in old], output=False)
            session.bind(input_names("s", len(old)), [m for _, m in old], output=False)
            session.bind(input_names("s", len(old), "_out"), [m for _, m in old], output=True)
        session.run()
        self.ort_runs += 1
        return bufs[2].clone()  # the buffer is rewritten by the next run


def _check_overflow_has_overflow_serial(orig: Callable, stats: GradStats) -> Callable:
    def has_overflow_serial(self, params):
        params = list(params)
        grads = [p.grad.data for p in params if p.grad is not None]
        if not GradStats.supports(grads):
            return orig(self, params)
        return bool(stats(grads)[1])
    return has_overflow_serial


APEX_SCALER_METHODS = ("unscale", "unscale_with_stashed", "unscale_python", "unscale_with_stashed_python",
                       "update_scale")
APEX_SCALER_FUNCTIONS = ("scale_check_overflow_python", "axpby_check_overflow_python")
_apex_scaler_checked: dict[type, list[str]] = {}


def _apex_scaler_refusals(cls: type) -> list[str]:
    """The methods (and the module functions they call) of a loss-scaler class whose source is
    not one we audited; our replacement stands in for them, so all must be known."""
    refused = _apex_scaler_checked.get(cls)
    if refused is None:
        refused = []
        for m in APEX_SCALER_METHODS:
            fn = getattr(cls, m, None)
            fp = fingerprint(fn) if callable(fn) else None
            if fp is None or fp not in KNOWN_SOURCES[f"{APEX_SCALER}.LossScaler.{m}"]:
                refused.append(f"{cls.__name__}.{m} (fingerprint {fp})")
        module_globals = getattr(getattr(cls, "unscale_python", None), "__globals__", {})
        for f in APEX_SCALER_FUNCTIONS:
            fn = module_globals.get(f)
            fp = fingerprint(fn) if callable(fn) else None
            if fp is None or fp not in KNOWN_SOURCES[f"{APEX_SCALER}.{f}"]:
                refused.append(f"{f} (fingerprint {fp})")
        _apex_scaler_checked[cls] = refused
        if refused:
            warnings.warn(f"FP16_Optimizer: apex's loss scaler {_qualname(cls)} has methods whose source differs "
                          f"from the versions ort_dynamo checked, so apex's own _post_amp_backward runs: {refused}",
                          UserWarning, stacklevel=4)
    return refused


def _apex_post_backward_with_master_weights(orig: Callable, unscale: ApexUnscale) -> Callable:
    models_are_masters = orig.__globals__["post_backward_models_are_masters"]

    def post_backward_with_master_weights(self, scaler):
        # apex's unscale() returns at once when the scaler already saw an overflow (Python
        # fallback, a second optimizer): leave that, and unknown scalers, to apex.
        if scaler._has_overflow or _apex_scaler_refusals(type(scaler)):
            return orig(self, scaler)
        stash = self._amp_stash
        self._amp_lazy_init()
        new, old = [], []  # the same split as apex: master grad to create / to accumulate into
        for fp16_param, fp32_param in zip(stash.all_fp16_params, stash.all_fp32_from_fp16_params):
            if fp16_param.grad is not None:
                (new if fp32_param.grad is None else old).append((fp16_param.grad, fp32_param))
        if not ApexUnscale.supports([g for g, _ in new + old], [p for _, p in new] + [p.grad for _, p in old]):
            return orig(self, scaler)
        for _, fp32_param in new:
            fp32_param.grad = torch.empty_like(fp32_param)
        found = unscale([g for g, _ in new], [p.grad for _, p in new], [g for g, _ in old],
                        [p.grad for _, p in old], scaler._loss_scale)
        if found is not None:
            if type(scaler).has_fused_kernel:
                # apex's kernels set _overflow_buf (read by update_scale) whatever `dynamic` is.
                scaler._overflow_buf.masked_fill_(found.to(scaler._overflow_buf.device), 1)
            elif scaler.dynamic:
                # The Python fallback checks only when dynamic, and a later unscale() then returns.
                scaler._has_overflow = bool(found)
        # fp32 params are treated as in the no-master-weights case, by apex itself.
        models_are_masters(scaler, stash.all_fp32_from_fp32_params, stash.all_fp32_from_fp32_grad_stash)
    return post_backward_with_master_weights


def _patch_apex(optimizer: Any, unscale: ApexUnscale, patched: list[str], refused: list[str]) -> None:
    post = getattr(optimizer, "_post_amp_backward", None)
    fn = getattr(post, "__func__", None)
    name = f"{APEX_PROCESS}.post_backward_with_master_weights"
    fp = fingerprint(fn) if getattr(post, "__self__", None) is optimizer else None
    if fp is None or fp not in KNOWN_SOURCES[name]:
        # O0/O1 (no master weights), FusedSGD or another apex revision.
        refused.append(f"_post_amp_backward = {getattr(fn, '__qualname__', post)} (fingerprint {fp}; only "
                       "apex O2's post_backward_with_master_weights is patched)")
        return
    optimizer._post_amp_backward = types.MethodType(_apex_post_backward_with_master_weights(fn, unscale), optimizer)
    patched.append(name)


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
    stats: GradStats | ApexUnscale = GradStats()
    if is_apex:
        stats = ApexUnscale()
        _patch_apex(optimizer, stats, patched, refused)
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
        library = "apex" if is_apex else f"DeepSpeed {_deepspeed_version()}"
        warnings.warn(f"FP16_Optimizer: {library} has methods whose source differs "
                      f"from the versions ort_dynamo checked, so they are left as they are: {refused}",
                      UserWarning, stacklevel=3)
    optimizer._ort_dynamo_patched = tuple(patched)
    optimizer._ort_dynamo_grad_stats = stats
    return optimizer
