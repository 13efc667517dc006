"""Special functions (gamma family, Bessel, error-function relatives, polynomials) as ONNX graphs."""

from __future__ import annotations

import torch

aten = torch.ops.aten

LOWERINGS: dict = {}
