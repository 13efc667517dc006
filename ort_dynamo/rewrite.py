"""Rewrite: ONNX model -> what ORT runs best (cleanup now, fused kernels as they land)."""

from __future__ import annotations

import onnx_ir as ir

from .export import ExportedGraph
from .options import OrtOptions

__all__ = ["rewrite"]


def rewrite(exported: ExportedGraph, options: OrtOptions) -> bytes:
    """Clean up ``exported.model`` in place and return the serialized model for ORT."""
    model = exported.model
    if options.enable_compute_optimizer and not options.deterministic_compute:
        import onnxscript.optimizer

        # Constant folding and dead-code removal; keeps graph inputs/outputs as they are.
        onnxscript.optimizer.optimize(model, num_iterations=2)
    ir.passes.common.RemoveUnusedFunctionsPass()(model)
    return ir.serde.serialize_model(model).SerializeToString()
