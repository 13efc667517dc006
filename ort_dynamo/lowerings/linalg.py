"""Linear algebra (inverse, determinant, solves, factorizations) as ONNX graphs."""

from __future__ import annotations

import torch

aten = torch.ops.aten

LOWERINGS: dict = {}
