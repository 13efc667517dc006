"""Extra ONNX lowerings: ops torchlib lacks, and replacements for torchlib lowerings that are wrong.

``register(registry)`` is called once by ``export.onnx_registry`` when the registry is built;
``register_library_ops(registry)`` on every use of it, since other libraries' ops (``library``)
may be defined after the registry was built.
Custom registrations go first in the registry, so they win over torchlib's own.

Each submodule has a ``LOWERINGS`` dict (torch op -> function), and may have
``ACCURATE_DTYPES`` (torch op -> dtypes): a lowering that is only accurate for some input
dtypes (an approximation tuned for float32, say) leaves the others in PyTorch
(``dtype_refusal``, asked by the partitioner). Each function is traced
(onnxscript trace-only): plain Python run at export time over the node's static attributes,
emitting ONNX ops.
"""

from __future__ import annotations

from onnxscript.values import Opset, TracedOnnxFunction

from . import attention, bessel, core, fixes, library, linalg, special
from ..lower import _overload  # "namespace::name" -> the op, None until a library defines it

import torch

__all__ = ["register", "register_library_ops", "dtype_refusal", "REMOVED_LOWERINGS"]

_OPSET = Opset("pkg.ort_dynamo", 1)
_MODULES = (core, special, bessel, linalg, fixes, attention)

REMOVED_LOWERINGS = core.REMOVED_LOWERINGS


def register(registry) -> None:
    """Add our lowerings to ``registry`` and drop the wrong torchlib ones."""
    for name in REMOVED_LOWERINGS:
        registry.functions.pop(name, None)
    for module in _MODULES:
        for target, fn in module.LOWERINGS.items():
            registry.register_op(target, TracedOnnxFunction(_OPSET, fn))


def register_library_ops(registry) -> None:
    """Add the lowerings of other libraries' ops that are defined by now and not yet added."""
    added = registry.__dict__.setdefault("_ort_dynamo_library_ops", set())
    for name, fn in library.LOWERINGS.items():
        if name not in added and (target := _overload(name)) is not None:
            registry.register_op(target, TracedOnnxFunction(_OPSET, fn))
            added.add(name)


_ACCURATE_DTYPES = {op: frozenset(dtypes) for module in _MODULES
                    for op, dtypes in getattr(module, "ACCURATE_DTYPES", {}).items()}


def dtype_refusal(node) -> str:
    """Why our lowering of ``node``'s op must not take its floating-point inputs ("" if it may)."""
    accurate = _ACCURATE_DTYPES.get(node.target)
    if accurate is None:
        return ""
    for arg in node.all_input_nodes:
        val = arg.meta.get("val")
        if isinstance(val, torch.Tensor) and val.is_floating_point() and val.dtype not in accurate:
            names = "/".join(sorted(str(d).replace("torch.", "") for d in accurate))
            return (f"ort_dynamo's lowering is accurate for {names} only; "
                    f"{str(val.dtype).replace('torch.', '')} runs in PyTorch")
    return ""
