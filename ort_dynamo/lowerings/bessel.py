"""Bessel and Airy functions and orthogonal polynomials as ONNX graphs."""

from __future__ import annotations

import torch

aten = torch.ops.aten

LOWERINGS: dict = {}
