"""FP16_Optimizer: dynamic loss scaling around any optimizer; one ORT graph per step checks,
unscales and clips all gradients.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from ..run import compute_stream
from ._graphs import unscale_clip_model
from ._session import BoundSession, input_names, onnx_type
from ._wrappers import patch_external_optimizer

__all__ = ["FP16_Optimizer"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)


class FP16_Optimizer:  # noqa: N801 (the name users know from onnxruntime-training / DeepSpeed)
    """Loss scaling for fp16 training around ``torch.optim`` optimizers and ``FusedAdam``.

    ``backward(loss)`` scales the loss; ``step()`` runs one ONNX Runtime graph that checks all
    gradients for inf/NaN, unscales them, computes their global L2 norm and (with
    ``max_grad_norm``) clips them like ``torch.nn.utils.clip_grad_norm_``, all written in place.
    On overflow the inner step is skipped and the scale is multiplied by ``backoff_factor``;
    after ``growth_interval`` clean steps it is multiplied by ``growth_factor``.

    Given a DeepSpeed fp16 optimizer (ZeRO stage 1/2 ``DeepSpeedZeroOptimizer``,
    ``FP16_Optimizer``, ``FP16_UnfusedOptimizer``: what ``deepspeed.initialize`` returns), it
    returns that same optimizer with its overflow checks and gradient norms replaced by one ORT
    graph each, as onnxruntime-training's ``FP16_Optimizer`` did; DeepSpeed keeps loss scaling,
    clipping and the step. Given an apex amp O2 optimizer, its ``_post_amp_backward`` (unscale
    of fp16 grads into fp32 master grads, with the overflow check) becomes one ORT graph; apex
    keeps the rest. See docs/optimizers.md for the versions checked.

    Args:
        optimizer: the optimizer to wrap (its ``param_groups`` hold the model's parameters).
        init_scale: first loss scale (default 2**16).
        growth_factor, backoff_factor, growth_interval: dynamic scaling (2.0, 0.5, 2000).
        min_scale: lowest scale. An overflow at this scale raises ``FloatingPointError``
            ("Current loss scale already at minimum") unless ``raise_at_min_scale=False``,
            in which case the step is skipped and the scale stays at ``min_scale``.
        max_grad_norm: clip the global grad norm to this value (None: no clipping).
        master_weights: keep float32 copies of float16/bfloat16 parameters; the inner
            optimizer updates the copies and the model gets them back rounded.
        dynamic_loss_scale: False keeps ``init_scale`` fixed (overflowing steps still skip).
    """

    def __new__(cls, optimizer: Any = None, *args, **kwargs):
        # apex amp patches the torch optimizer it was given, so check for it first.
        if hasattr(optimizer, "_amp_stash") or not isinstance(optimizer, torch.optim.Optimizer):
            given = [f"positional argument {i + 2}" for i in range(len(args))] + sorted(kwargs)
            patched = patch_external_optimizer(optimizer, given)
            if patched is not None:
                return patched  # not an FP16_Optimizer, so __init__ does not run
        return super().__new__(cls)

    def __init__(self, optimizer: torch.optim.Optimizer, init_scale: float = 2.0 ** 16,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5, growth_interval: int = 2000,
                 min_scale: float = 1.0, max_grad_norm: float | None = None, master_weights: bool = False,
                 dynamic_loss_scale: bool = True, raise_at_min_scale: bool = True) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"FP16_Optimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if not (init_scale > 0 and math.isfinite(init_scale)):
            raise ValueError(f"init_scale must be a positive finite number, got {init_scale}")
        if not growth_factor > 1.0:
            raise ValueError(f"growth_factor must be > 1, got {growth_factor}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor}")
        if not (isinstance(growth_interval, int) and growth_interval > 0):
            raise ValueError(f"growth_interval must be a positive int, got {growth_interval!r}")
        if not 0 < min_scale <= init_scale:
            raise ValueError(f"min_scale must be in (0, init_scale], got {min_scale}")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be positive or None, got {max_grad_norm}")
        self.optimizer = optimizer
        self.loss_scale = float(init_scale)
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self.growth_interval, self.min_scale = growth_interval, float(min_scale)
        self.max_grad_norm = max_grad_norm
        self.dynamic_loss_scale, self.raise_at_min_scale = dynamic_loss_scale, raise_at_min_scale
        self.growth_tracker = 0
        self.overflow = False
        self.grad_norm: float | None = None  # global norm of the unscaled grads at the last step
        self.skipped_steps = 0
        self.ort_runs = 0
        self.graphs_built = 0
        self._sessions: dict[tuple, BoundSession] = {}
        self._buffers: dict[torch.device, tuple] = {}
        # The model's parameters, in param-group order; with master weights the optimizer's
        # groups hold float32 copies of the low-precision ones instead.
        self.model_params = [p for g in optimizer.param_groups for p in g["params"]]
        self.master_params: list[torch.Tensor] | None = None
        if master_weights:
            self._make_master_weights()

    # -- optimizer protocol -------------------------------------------------------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        """``(loss * loss_scale).backward()``: small fp16 gradients stay representable."""
        (loss.float() * self.loss_scale).backward(retain_graph=retain_graph)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.model_params:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_().zero_()

    def step(self, closure: Callable[[], Any] | None = None):
        """Unscale/check/clip in one ORT run, then the inner step unless gradients overflowed.

        A closure must call ``self.backward(loss)``. Returns the closure's loss.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad():
            self.overflow = self._unscale_and_clip()
            if self.overflow:
                self._back_off()
                return loss
            self.optimizer.step()
            if self.master_params is not None:
                model = [p for p, m in zip(self.model_params, self.master_params) if p is not m]
                masters = [m for p, m in zip(self.model_params, self.master_params) if p is not m]
                if model:
                    torch._foreach_copy_(model, masters)
        self.growth_tracker += 1
        if self.dynamic_loss_scale and self.growth_tracker >= self.growth_interval:
            self.loss_scale *= self.growth_factor
            self.growth_tracker = 0
        return loss

    def state_dict(self) -> dict[str, Any]:
        return {
            "optimizer": self.optimizer.state_dict(),
            "loss_scaler": {"loss_scale": self.loss_scale, "growth_tracker": self.growth_tracker,
                            "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
                            "growth_interval": self.growth_interval, "min_scale": self.min_scale,
                            "dynamic_loss_scale": self.dynamic_loss_scale,
                            "skipped_steps": self.skipped_steps},
            "master_params": None if self.master_params is None else list(self.master_params),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for key in ("optimizer", "loss_scaler"):
            if key not in state_dict:
                raise ValueError(f"not an FP16_Optimizer state_dict: no '{key}' entry")
        self.optimizer.load_state_dict(state_dict["optimizer"])
        scaler = state_dict["loss_scaler"]
        self.loss_scale = float(scaler["loss_scale"])
        self.growth_tracker = int(scaler["growth_tracker"])
        self.growth_factor, self.backoff_factor = scaler["growth_factor"], scaler["backoff_factor"]
        self.growth_interval, self.min_scale = scaler["growth_interval"], scaler["min_scale"]
        self.dynamic_loss_scale = scaler.get("dynamic_loss_scale", True)
        self.skipped_steps = scaler.get("skipped_steps", 0)
        saved = state_dict.get("master_params")
        if (saved is None) != (self.master_params is None):
            raise ValueError("state_dict and this FP16_Optimizer disagree on master_weights")
        if saved is not None:
            with torch.no_grad():
                for m, s in zip(self.master_params, saved):
                    m.copy_(s)

    def __repr__(self) -> str:
        return (f"FP16_Optimizer(loss_scale={self.loss_scale}, max_grad_norm={self.max_grad_norm}, "
                f"master_weights={self.master_params is not None}, optimizer={self.optimizer!r})")

    # -- internals ------------------------------------------------------------------------------

    def _make_master_weights(self) -> None:
        if any(self.optimizer.state.get(p) for p in self.model_params):
            raise ValueError("master_weights=True needs an optimizer that has not stepped yet "
                             "(its state is keyed by the model's parameters)")
        masters = []
        for group in self.optimizer.param_groups:
            new_params = []
            for p in group["params"]:
                if p.dtype in _LOW_PRECISION:
                    m = p.detach().float().clone().requires_grad_(True)
                else:
                    m = p
                new_params.append(m)
                masters.append(m)
            group["params"] = new_params
        self.master_params = masters
        if hasattr(self.optimizer, "_params_changed"):
            self.optimizer._params_changed()

    def _unscale_and_clip(self) -> bool:
        pairs = []  # (model param, where its unscaled grad goes)
        for i, p in enumerate(self.model_params):
            g = p.grad
            if g is None:
                if self.master_params is not None and self.master_params[i] is not p:
                    self.master_params[i].grad = None
                continue
            if g.is_sparse:
                raise RuntimeError("FP16_Optimizer does not support sparse gradients")
            if g.numel() == 0:
                continue
            if not g.is_contiguous():
                p.grad = g = g.contiguous()
            out = g
            if self.master_params is not None and self.master_params[i] is not p:
                m = self.master_params[i]
                if m.grad is None or m.grad.shape != g.shape:
                    m.grad = torch.empty(g.shape, dtype=torch.float32, device=g.device)
                out = m.grad
            pairs.append((g, out))
        if not pairs:
            self.grad_norm = 0.0
            return False
        devices = {g.device for g, _ in pairs}
        if len(devices) > 1:
            raise ValueError(f"FP16_Optimizer needs all gradients on one device, got {sorted(map(str, devices))}")
        device = devices.pop()
        grads = [g for g, _ in pairs]
        outs = [o for _, o in pairs]
        session = self._session(device, grads, outs)
        scalars, inv_scale, max_norm, norm, found_inf = self._scalars(device)
        scalars.copy_(torch.tensor([1.0 / self.loss_scale, self.max_grad_norm or 0.0]))
        n = len(grads)
        session.bind(("inv_scale", "max_norm"), (inv_scale, max_norm), output=False)
        session.bind(input_names("g", n), grads, output=False)
        session.bind(input_names("g", n, "_out"), outs, output=True)
        session.bind(("norm", "found_inf"), (norm, found_inf), output=True)
        session.run()
        self.ort_runs += 1
        self.grad_norm = float(norm)
        return bool(found_inf)

    def _session(self, device: torch.device, grads: list, outs: list) -> BoundSession:
        stream = compute_stream(device)
        key = (device, stream, self.max_grad_norm is not None,
               tuple((g.numel(), g.dtype, o.dtype) for g, o in zip(grads, outs)))
        session = self._sessions.get(key)
        if session is None:
            master = any(o.dtype != g.dtype for g, o in zip(grads, outs))
            if master and not all(o.dtype == torch.float32 for o in outs):
                raise AssertionError("master gradients are float32")
            model = unscale_clip_model([g.numel() for g in grads], [onnx_type(g.dtype) for g in grads],
                                       clip=self.max_grad_norm is not None, master_grads=master)
            session = BoundSession(model, device)
            self._sessions[key] = session
            self.graphs_built += 1
        return session

    def _scalars(self, device: torch.device) -> tuple:
        entry = self._buffers.get(device)
        if entry is None:
            scalars = torch.zeros(2, dtype=torch.float32, device=device)
            inv_scale, max_norm = scalars.unbind()
            entry = (scalars, inv_scale, max_norm, torch.zeros((), dtype=torch.float32, device=device),
                     torch.zeros((), dtype=torch.bool, device=device))
            self._buffers[device] = entry
        return entry

    def _back_off(self) -> None:
        self.skipped_steps += 1
        self.growth_tracker = 0
        if not self.dynamic_loss_scale:
            return
        if self.loss_scale <= self.min_scale:
            if self.raise_at_min_scale:
                raise FloatingPointError(
                    f"Current loss scale already at minimum ({self.min_scale}) - cannot decrease scale "
                    "anymore: gradients overflow even at the minimum scale (check the model for "
                    "inf/NaN, or lower min_scale).")
            return
        self.loss_scale = max(self.loss_scale * self.backoff_factor, self.min_scale)
