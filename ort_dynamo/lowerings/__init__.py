"""Extra ONNX lowerings: ops torchlib lacks, and replacements for torchlib lowerings that are wrong.

``register(registry)`` is called once by ``export.onnx_registry`` when the registry is built.
Custom registrations go first in the registry, so they win over torchlib's own.

Each submodule has a ``LOWERINGS`` dict (torch op -> function). Each function is traced
(onnxscript trace-only): plain Python run at export time over the node's static attributes,
emitting ONNX ops.
"""

from __future__ import annotations

from onnxscript.values import Opset, TracedOnnxFunction

from . import core, linalg, special

__all__ = ["register", "REMOVED_LOWERINGS"]

_OPSET = Opset("pkg.ort_dynamo", 1)
_MODULES = (core, special, linalg)

REMOVED_LOWERINGS = core.REMOVED_LOWERINGS


def register(registry) -> None:
    """Add our lowerings to ``registry`` and drop the wrong torchlib ones."""
    for name in REMOVED_LOWERINGS:
        registry.functions.pop(name, None)
    for module in _MODULES:
        for target, fn in module.LOWERINGS.items():
            registry.register_op(target, TracedOnnxFunction(_OPSET, fn))
