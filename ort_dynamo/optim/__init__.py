"""Optimizer steps compiled to ONNX Runtime: ``FusedAdam`` and ``FP16_Optimizer``.

``from ort_dynamo.optim import FusedAdam`` replaces ``onnxruntime.training.optim.FusedAdam``;
see docs/optimizers.md.
"""

from ._graphs import AdamWMode
from .fp16_optimizer import FP16_Optimizer
from .fused_adam import FusedAdam

__all__ = ["AdamWMode", "FP16_Optimizer", "FusedAdam"]
