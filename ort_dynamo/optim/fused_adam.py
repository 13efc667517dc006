"""FusedAdam: the whole Adam step of a (device, dtype) group is one ONNX Runtime run.

Drop-in for ``onnxruntime.training.optim.FusedAdam`` (same arguments and defaults) and for
``torch.optim.Adam``/``AdamW`` (same ``state_dict`` format). See docs/optimizers.md.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable, Iterable

import torch

from ..run import compute_stream
from ._graphs import HYPER_NAMES, AdamWMode, adam_step_model
from ._session import BoundSession, input_names, onnx_type

__all__ = ["FusedAdam", "AdamWMode"]

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


class _Subgroup:
    """The parameters of one param group sharing a (device, dtype): one graph run per step.

    ``steps`` holds the step count of each of them; ``state[p]["step"]`` is a 0-d view of it,
    so the graph increments all counts in place and checkpoints see torch's per-param steps.
    """

    def __init__(self, params: list[torch.Tensor], device: torch.device, dtype: torch.dtype) -> None:
        self.params = params
        self.device = device
        self.dtype = dtype
        self.steps = torch.zeros(len(params), dtype=torch.float32, device=device)
        # lr, beta1, beta2, eps, weight_decay: one host write per step, bound as 0-d views.
        self.hyper = torch.zeros(len(HYPER_NAMES), dtype=torch.float64, device=device)
        self.hyper_views = list(self.hyper.unbind())

    def set_hyper(self, values: tuple) -> None:
        if self.device.type == "cpu":
            self.hyper.numpy()[:] = values
        else:  # a pageable source: the copy is done before the host could overwrite it
            self.hyper.copy_(torch.tensor(values, dtype=torch.float64))


class FusedAdam(torch.optim.Optimizer):
    """Adam/AdamW whose step runs as one ONNX Runtime graph per (device, dtype) of a group.

    Arguments and defaults are those of onnxruntime-training's FusedAdam:

    Args:
        params: parameters or param-group dicts.
        lr: learning rate (default 1e-3).
        bias_correction: divide the moments by ``1 - beta**step`` (default True).
        betas: (beta1, beta2) (default (0.9, 0.999)).
        eps: added to the denominator (default 1e-6, as ORT; torch's AdamW uses 1e-8).
        adam_w_mode: an ``AdamWMode`` (default ``ADAMW_TRANSFORMERS``):
            ``ADAM_L2_REGULARIZATION`` = torch.optim.Adam(weight_decay=wd),
            ``ADAMW_TRANSFORMERS`` = transformers' AdamW, ``ADAMW_TORCH`` = torch.optim.AdamW.
        weight_decay: decay factor (default 0).
        set_grad_none: ``zero_grad()`` sets grads to None whatever its argument (default True).

    float16/bfloat16 parameters keep float32 ``exp_avg``/``exp_avg_sq`` and update in float32.
    ``ort_runs`` counts ORT runs and ``graphs_built`` counts graphs built (sessions created).
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 adam_w_mode: AdamWMode = AdamWMode.ADAMW_TRANSFORMERS, weight_decay: float = 0.0,
                 set_grad_none: bool = True) -> None:
        _check_hyper(lr, betas, eps, weight_decay)
        try:
            self.adam_w_mode = AdamWMode(adam_w_mode)
        except ValueError:
            raise ValueError(f"adam_w_mode must be an AdamWMode (0, 1 or 2), got {adam_w_mode!r}") from None
        self.set_grad_none = set_grad_none
        self.ort_runs = 0
        self.graphs_built = 0
        self._sessions: dict[tuple, BoundSession] = {}
        self._subgroups: list[list[_Subgroup]] | None = None
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)

    # -- param groups and state ---------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        self._params_changed()

    def _params_changed(self) -> None:
        """Call after editing ``param_groups[i]["params"]``: regroups at the next step."""
        self._subgroups = None

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            for key, value in self.defaults.items():
                group.setdefault(key, value)
        self._subgroups = None

    def _layout(self) -> list[list[_Subgroup]]:
        """Split each group by (device, dtype); step counts move into one buffer per subgroup."""
        if self._subgroups is not None:
            return self._subgroups
        layout = []
        for group in self.param_groups:
            by_key: dict[tuple, list[torch.Tensor]] = {}
            for p in group["params"]:
                if p.dtype not in _SUPPORTED_DTYPES:
                    raise TypeError(f"FusedAdam supports float32/float16/bfloat16/float64 parameters, got {p.dtype}")
                if p.device.type not in ("cpu", "cuda"):
                    raise ValueError(f"FusedAdam runs on CPU and CUDA parameters, got one on {p.device}")
                if not is_non_overlapping_and_dense(p):
                    raise ValueError(f"FusedAdam updates parameters in place and needs dense storage; "
                                     f"a parameter of shape {tuple(p.shape)} has strides {p.stride()}")
                by_key.setdefault((p.device, p.dtype), []).append(p)
            subs = []
            for (device, dtype), params in by_key.items():
                sub = _Subgroup(params, device, dtype)
                for i, p in enumerate(params):
                    state = self.state.get(p)
                    if state and "step" in state:
                        sub.steps[i] = float(state["step"])
                        state["step"] = sub.steps[i]
                subs.append(sub)
            layout.append(subs)
        self._subgroups = layout
        return layout

    def state_dict(self) -> dict[str, Any]:
        """torch.optim.Adam/AdamW's format. ``step`` entries are CPU float32 copies, not views."""
        sd = super().state_dict()
        # torch packs our live per-param dicts: copy them before replacing the step views.
        sd["state"] = {idx: _with_step_copy(entry) for idx, entry in sd["state"].items()}
        sd["param_groups"] = [dict(g, adam_w_mode=int(self.adam_w_mode)) for g in sd["param_groups"]]
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load FusedAdam's or torch.optim.Adam/AdamW's ``state_dict``; tensors are copied.

        float16/bfloat16 parameters get their moments back in float32 (torch would cast them
        to the parameter's dtype).
        """
        for group in state_dict["param_groups"]:
            for flag in ("amsgrad", "maximize"):
                if group.get(flag):
                    raise ValueError(f"FusedAdam cannot load a state_dict with {flag}=True (not supported)")
        saved_modes = {g["adam_w_mode"] for g in state_dict["param_groups"] if "adam_w_mode" in g}
        if saved_modes and saved_modes != {int(self.adam_w_mode)}:
            warnings.warn(f"loading a FusedAdam state_dict saved with adam_w_mode={sorted(saved_modes)} into one "
                          f"with {self.adam_w_mode.name}: the state loads, updates follow "
                          f"{self.adam_w_mode.name}", stacklevel=2)
        saved_state = state_dict["state"]
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            group.pop("adam_w_mode", None)
        params = [p for g in self.param_groups for p in g["params"]]
        for saved_id, p in zip(saved_ids, params):
            if saved_id not in saved_state:
                continue
            saved = saved_state[saved_id]
            missing = {"step", "exp_avg", "exp_avg_sq"} - set(saved)
            if missing:
                raise ValueError(f"state of parameter {saved_id} lacks {sorted(missing)}; "
                                 "FusedAdam loads Adam/AdamW state only")
            moment_dtype = _state_dtype(p.dtype)
            self.state[p] = {
                "step": torch.tensor(float(saved["step"]), dtype=torch.float32),
                "exp_avg": _own_copy(saved["exp_avg"], p, moment_dtype),
                "exp_avg_sq": _own_copy(saved["exp_avg_sq"], p, moment_dtype),
            }
        self._subgroups = None

    # -- zero_grad and step -----------------------------------------------------------------------

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=self.set_grad_none or set_to_none)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None):
        """One Adam step; returns ``closure()``'s loss when a closure is given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group, subgroups in zip(self.param_groups, self._layout()):
            beta1, beta2 = group["betas"]
            _check_hyper(group["lr"], group["betas"], group["eps"], group["weight_decay"])
            hyper = (float(group["lr"]), float(beta1), float(beta2), float(group["eps"]),
                     float(group["weight_decay"]))
            for sub in subgroups:
                self._step_subgroup(sub, hyper, bool(group["bias_correction"]))
        return loss

    def _step_subgroup(self, sub: _Subgroup, hyper: tuple, bias_correction: bool) -> None:
        slots, param_slots, params, grads, exp_avgs, exp_avg_sqs = [], [], [], [], [], []
        state = self.state
        for slot, p in enumerate(sub.params):
            g = p.grad
            if g is None:
                continue
            if g.is_sparse:
                raise RuntimeError("FusedAdam does not support sparse gradients, please consider SparseAdam instead")
            if g.dtype != p.dtype or g.shape != p.shape or g.device != p.device:
                raise ValueError(f"gradient ({g.dtype}, {tuple(g.shape)}, {g.device}) does not match its "
                                 f"parameter ({p.dtype}, {tuple(p.shape)}, {p.device})")
            if p.dtype != sub.dtype or p.device != sub.device:
                raise RuntimeError(f"a parameter moved from ({sub.dtype}, {sub.device}) to ({p.dtype}, {p.device}) "
                                   "after FusedAdam grouped it; create the optimizer after .to()/.half()")
            if not p.is_contiguous() and not is_non_overlapping_and_dense(p):
                raise ValueError(f"FusedAdam updates parameters in place and needs dense storage; "
                                 f"a parameter of shape {tuple(p.shape)} has strides {p.stride()}")
            if g.stride() != p.stride():
                g = torch.empty_like(p).copy_(g)  # same layout as the parameter, elementwise
            st = state[p]
            if not st:
                moment_dtype = _state_dtype(p.dtype)
                st["step"] = sub.steps[slot]
                st["exp_avg"] = torch.zeros_like(p, dtype=moment_dtype)
                st["exp_avg_sq"] = torch.zeros_like(p, dtype=moment_dtype)
            slots.append(slot)
            if p.numel():  # empty parameters only count the step
                param_slots.append(slot)
                params.append(p)
                grads.append(g)
                exp_avgs.append(st["exp_avg"])
                exp_avg_sqs.append(st["exp_avg_sq"])
        if not slots:
            return
        if not params:  # only empty parameters: nothing to update but their step counts
            sub.steps[slots] += 1
            return
        session = self._session(sub, slots, param_slots, [p.numel() for p in params], bias_correction)
        sub.set_hyper(hyper)
        n = len(params)
        session.bind(("steps",), (sub.steps,), output=False)
        session.bind(("steps_out",), (sub.steps,), output=True)
        session.bind(HYPER_NAMES, sub.hyper_views, output=False)
        session.bind(input_names("p", n), params, output=False)
        session.bind(input_names("g", n), grads, output=False)
        session.bind(input_names("m", n), exp_avgs, output=False)
        session.bind(input_names("v", n), exp_avg_sqs, output=False)
        session.bind(input_names("p", n, "_out"), params, output=True)
        session.bind(input_names("m", n, "_out"), exp_avgs, output=True)
        session.bind(input_names("v", n, "_out"), exp_avg_sqs, output=True)
        session.run()
        self.ort_runs += 1

    def _session(self, sub: _Subgroup, slots: list[int], param_slots: list[int], numels: list[int],
                 bias_correction: bool) -> BoundSession:
        stream = compute_stream(sub.device)
        key = (sub.device, sub.dtype, len(sub.params), tuple(slots), tuple(numels),
               self.adam_w_mode, bias_correction, stream)
        session = self._sessions.get(key)
        if session is None:
            model = adam_step_model(numels, param_slots, slots, len(sub.params), onnx_type(sub.dtype),
                                    self.adam_w_mode, bias_correction)
            session = BoundSession(model, sub.device, pointwise_kernels=True)
            self._sessions[key] = session
            self.graphs_built += 1
        return session


def is_non_overlapping_and_dense(t: torch.Tensor) -> bool:
    """True when the elements fill their storage span exactly once (any dim order)."""
    expected = 1
    dims = sorted((st, s) for s, st in zip(t.shape, t.stride()) if s != 1)
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def _with_step_copy(entry: dict[str, Any]) -> dict[str, Any]:
    entry = dict(entry)
    if "step" in entry:
        entry["step"] = entry["step"].detach().to("cpu", torch.float32, copy=True)
    return entry


def _state_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _own_copy(value: torch.Tensor, p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if value.shape != p.shape:
        raise ValueError(f"saved optimizer state of shape {tuple(value.shape)} does not match "
                         f"its parameter of shape {tuple(p.shape)}")
    out = torch.empty_like(p, dtype=dtype)
    out.copy_(value)
    return out


def _check_hyper(lr, betas, eps, weight_decay) -> None:
    if isinstance(lr, torch.Tensor):
        raise TypeError("FusedAdam takes lr as a float (tensor lr is not supported)")
    if not 0.0 <= lr or not math.isfinite(lr):
        raise ValueError(f"Invalid learning rate: {lr}")
    if not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps}")
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"Invalid betas (each in [0, 1)): {betas}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")
