"""Subscribers and the manager that runs them on every ``nn.Module`` forward output.

Every module's forward outputs pass through ``_InspectActivation``: its forward hands the
activation to the subscribers, its backward hands them the activation's gradient.

Under ``torch.compile`` the hooks run eagerly (``torch._dynamo.disable``): Dynamo breaks the
graph at each hooked module, so ONNX Runtime computes each module's ops and the hooks see
ORT's results. That costs one graph (forward and backward) per module call instead of one
for the model; unsubscribe for speed runs.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Iterable

import torch
import torch.utils._pytree as pytree

__all__ = ["SubscriberBase", "SubscriberManager", "RunContext", "GlobalSubscriberManager",
           "inspect_activation"]


class SubscriberBase:
    """Receives activations and gradients of steps in ``[start_step, end_step)``."""

    def __init__(self, start_step: int | None = None, end_step: int | None = None) -> None:
        for name, value in (("start_step", start_step), ("end_step", end_step)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise ValueError(f"{name} must be None or an int >= 0, got {value!r}")
        if start_step is not None and end_step is not None and end_step <= start_step:
            raise ValueError(f"end_step ({end_step}) must be greater than start_step ({start_step})")
        self.start_step = start_step
        self.end_step = end_step

    def wants(self, step: int) -> bool:
        if self.start_step is not None and step < self.start_step:
            return False
        return self.end_step is None or step < self.end_step

    def on_forward(self, name: str, tensor: torch.Tensor, depth: int, step: int) -> None:
        """``tensor`` is a detached activation of ``step``."""

    def on_backward(self, name: str, grad: torch.Tensor, depth: int, step: int) -> None:
        """``grad`` is the detached gradient of activation ``name`` of ``step``."""


@dataclasses.dataclass
class RunContext:
    """What the manager knows while running: the step and the module numbering."""

    step: int = 0
    module_index: dict = dataclasses.field(default_factory=weakref.WeakKeyDictionary)
    module_depth: dict[int, int] = dataclasses.field(default_factory=dict)
    #: Activation names recorded in the forward of the current step (unique per step).
    names_this_step: set[str] = dataclasses.field(default_factory=set)


class _InspectActivation(torch.autograd.Function):
    """Identity whose forward reports the activation and whose backward reports its gradient."""

    @staticmethod
    def forward(ctx, name: str, depth: int, step: int, subscribers: tuple, tensor: torch.Tensor):
        ctx.name, ctx.depth, ctx.step, ctx.subscribers = name, depth, step, subscribers
        _notify_forward(subscribers, name, tensor, depth, step)
        return tensor.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if grad is not None:
            for sub in ctx.subscribers:
                sub.on_backward(ctx.name, grad.detach(), ctx.depth, ctx.step)
        return None, None, None, None, grad


def _notify_forward(subscribers: Iterable[SubscriberBase], name: str, tensor: torch.Tensor,
                    depth: int, step: int) -> None:
    for sub in subscribers:
        sub.on_forward(name, tensor.detach(), depth, step)


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The user's module under a ``torch.compile`` wrapper (OptimizedModule)."""
    while hasattr(model, "_orig_mod") and isinstance(model._orig_mod, torch.nn.Module):
        model = model._orig_mod
    return model


#: The manager whose model is running a forward: ``inspect_activation`` reports to it.
_ACTIVE: list["SubscriberManager"] = []


class SubscriberManager:
    """Registers subscribers' hooks on a model. ``GlobalSubscriberManager`` is the usual one."""

    def __init__(self) -> None:
        self._ctx = RunContext()
        self._subscribers: tuple[SubscriberBase, ...] = ()
        self._handles: list = []
        self._calls: dict[int, int] = {}  # module index -> calls in this forward

    # -- public -----------------------------------------------------------------------------------

    def subscribe(self, model: torch.nn.Module, subscribers: list[SubscriberBase]) -> None:
        """Hook ``subscribers`` onto every module of ``model`` (eager or ``torch.compile``d).

        Replaces what an earlier ``subscribe`` of this manager installed; the step restarts at 0.
        """
        if not isinstance(model, torch.nn.Module):
            raise ValueError(f"subscribe() needs a torch.nn.Module, got {type(model).__name__}")
        subscribers = list(subscribers)
        if not subscribers:
            raise ValueError("subscribe() needs at least one subscriber")
        for sub in subscribers:
            if not isinstance(sub, SubscriberBase):
                raise ValueError(f"subscribers must be SubscriberBase instances, got {type(sub).__name__}")
        self.unsubscribe()
        self._subscribers = tuple(subscribers)
        root = _unwrap(model)
        self._number_modules(root)
        for module in root.modules():
            self._handles.append(module.register_forward_hook(self._post_forward_hook))
        self._handles.append(root.register_forward_pre_hook(self._root_pre_forward_hook))
        # Registered last so the root's own outputs are reported before the step advances.
        self._handles.append(root.register_forward_hook(self._root_post_forward_hook))
        # Dynamo may hold code compiled before these hooks existed; make it trace them.
        torch._dynamo.reset()

    def unsubscribe(self) -> None:
        """Remove every hook this manager installed."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._subscribers = ()
        self._ctx = RunContext()

    def get_run_context(self) -> RunContext:
        return self._ctx

    @property
    def step(self) -> int:
        """The step the next (or running) forward belongs to."""
        return self._ctx.step

    @property
    def subscribers(self) -> tuple[SubscriberBase, ...]:
        return self._subscribers

    # -- hooks ------------------------------------------------------------------------------------

    def _number_modules(self, root: torch.nn.Module) -> None:
        """Pre-order numbering (root 0, depth 1), the order the activation names use."""
        def visit(module: torch.nn.Module, depth: int) -> None:
            if module in self._ctx.module_index:
                return
            index = len(self._ctx.module_depth)
            self._ctx.module_index[module] = index
            self._ctx.module_depth[index] = depth
            for child in module.children():
                visit(child, depth + 1)
        visit(root, 1)

    @torch._dynamo.disable
    def _root_pre_forward_hook(self, module, args):
        _ACTIVE.append(self)
        self._ctx.names_this_step.clear()
        self._calls.clear()

    @torch._dynamo.disable
    def _root_post_forward_hook(self, module, args, output):
        if _ACTIVE and _ACTIVE[-1] is self:
            _ACTIVE.pop()
        self._ctx.step += 1
        for sub in self._subscribers:
            finish = getattr(sub, "on_step_end", None)
            if finish is not None:
                finish(self._ctx.step - 1)

    @torch._dynamo.disable
    def _post_forward_hook(self, module, args, output):
        index = self._ctx.module_index.get(module)
        if index is None:  # a module added to the model after subscribe()
            return output
        calls = self._calls.get(index, 0)
        self._calls[index] = calls + 1
        suffix = f"_call{calls}" if calls else ""  # a module run twice in one forward
        leaves, spec = pytree.tree_flatten(output)
        changed = False
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor):
                name = f"{type(module).__name__}_{index}_{i}th_output{suffix}"
                leaves[i] = self._inspect(name, leaf, self._ctx.module_depth[index])
                changed = True
        return pytree.tree_unflatten(leaves, spec) if changed else output

    def _inspect(self, name: str, tensor: torch.Tensor, depth: int) -> torch.Tensor:
        self._ctx.names_this_step.add(name)
        step = self._ctx.step
        active = tuple(s for s in self._subscribers if s.wants(step))
        if not active:
            return tensor
        if tensor.requires_grad and torch.is_grad_enabled():
            return _InspectActivation.apply(name, depth, step, active, tensor)
        _notify_forward(active, name, tensor, depth, step)
        return tensor


@torch._dynamo.disable
def inspect_activation(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """Report an intermediate ``tensor`` (and later its gradient) as activation ``name``.

    Use the returned tensor in place of ``tensor`` so the gradient passes through the tap::

        logits = inspect_activation("lm_logits", logits)

    Names must be unique within one forward pass. Outside a subscribed model's forward, it
    returns ``tensor`` unchanged.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"inspect_activation needs a non-empty str name, got {name!r}")
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"inspect_activation({name!r}, ...) needs a torch.Tensor, got {type(tensor).__name__}")
    manager = _ACTIVE[-1] if _ACTIVE else GlobalSubscriberManager
    if not manager.subscribers:
        return tensor
    ctx = manager.get_run_context()
    if name in ctx.names_this_step:
        raise ValueError(
            f"activation name {name!r} was already recorded in step {ctx.step}; names passed to "
            "inspect_activation must be unique within one forward pass (and must not repeat a "
            "module activation's name)")
    return manager._inspect(name, tensor, depth=0)


#: The manager the guide's workflow uses: ``GlobalSubscriberManager.subscribe(model, [...])``.
GlobalSubscriberManager = SubscriberManager()


def flatten_tensors(value: Any) -> list[torch.Tensor]:
    return [leaf for leaf in pytree.tree_leaves(value) if isinstance(leaf, torch.Tensor)]
