#!/usr/bin/env python3
"""Special-values sweep: elementwise and reduction ops on NaN, +-inf, +-0.0, subnormals, huge
and tiny values (every pair of them for binary ops), eager vs ``backend="ort"``.

The OpInfo sweep (tools/opinfo_sweep.py) draws ordinary random inputs; this one is where
NaN ordering, clipped infinities and lost precision near zero show up. It prints each op
whose result differs (NaN where eager has none or the reverse, values off by more than
rtol 1e-4 / atol 1e-6, or the sign of a zero) with the first inputs that differ.

    .venv/bin/python tools/special_values_sweep.py            # all ops
    .venv/bin/python tools/special_values_sweep.py atan2 pow  # some

What it found, and what was fixed, is in docs/ops.md ("Wrong results found by the sweep").
"""

from __future__ import annotations

import sys
import warnings

import torch
import torch.nn.functional as F

import ort_dynamo

NAN, INF = float("nan"), float("inf")
VALUES = torch.tensor([NAN, INF, -INF, -0.0, 0.0, 1.0, -1.0, 0.5, -0.5, 2.5, -2.5, 1e30, -1e30, 1e-40, 3.0, 20.0, -20.0,
                       88.8, -104.0, 1e-6])
X = VALUES
A, B = (t.reshape(-1) for t in torch.meshgrid(VALUES, VALUES, indexing="ij"))
ROWS = A.view(len(VALUES), len(VALUES))
INTS = torch.tensor([-7, -2, -1, 0, 1, 2, 7, 2**40, -(2**40)])
I, J = (t.reshape(-1) for t in torch.meshgrid(INTS, INTS, indexing="ij"))
J = torch.where(J == 0, torch.ones_like(J), J)

UNARY = ["abs", "acos", "acosh", "asin", "asinh", "atan", "atanh", "ceil", "cos", "cosh", "deg2rad", "digamma",
         "erf", "erfc", "erfinv", "exp", "exp2", "expm1", "floor", "frac", "i0", "lgamma", "log", "log10", "log1p",
         "log2", "logit", "nan_to_num", "neg", "rad2deg", "reciprocal", "round", "rsqrt", "sigmoid", "sign", "sin",
         "sinc", "sinh", "sqrt", "square", "tan", "tanh", "trunc", "relu", "isfinite", "isinf", "isnan",
         "isposinf", "isneginf", "signbit"]

CASES = {name: (lambda name=name: getattr(torch, name)(X)) for name in UNARY}
CASES.update({
    "gelu": lambda: F.gelu(X), "gelu_tanh": lambda: F.gelu(X, approximate="tanh"), "silu": lambda: F.silu(X),
    "softplus": lambda: F.softplus(X), "mish": lambda: F.mish(X), "elu": lambda: F.elu(X), "selu": lambda: F.selu(X),
    "celu": lambda: F.celu(X), "hardswish": lambda: F.hardswish(X), "hardsigmoid": lambda: F.hardsigmoid(X),
    "logsigmoid": lambda: F.logsigmoid(X), "leaky_relu": lambda: F.leaky_relu(X), "relu6": lambda: F.relu6(X),
    "hardtanh": lambda: F.hardtanh(X), "softsign": lambda: F.softsign(X), "hardshrink": lambda: F.hardshrink(X),
    "softshrink": lambda: F.softshrink(X), "threshold": lambda: F.threshold(X, 0.5, -3.0),
    "clamp": lambda: X.clamp(-1, 1), "clamp_min": lambda: X.clamp(min=0.1), "clamp_max": lambda: X.clamp(max=0.1),
    "pow_0.5": lambda: X ** 0.5, "pow_-0.5": lambda: X ** -0.5, "pow_2": lambda: X ** 2, "pow_-1": lambda: X ** -1,
    "rpow": lambda: 2.0 ** X, "round_decimals": lambda: torch.round(X, decimals=2),
    "add": lambda: A + B, "sub": lambda: A - B, "mul": lambda: A * B, "div": lambda: A / B,
    "div_floor": lambda: torch.div(A, B, rounding_mode="floor"), "div_trunc": lambda: torch.div(A, B, rounding_mode="trunc"),
    "remainder": lambda: torch.remainder(A, B), "fmod": lambda: torch.fmod(A, B), "pow": lambda: torch.pow(A, B),
    "atan2": lambda: torch.atan2(A, B), "hypot": lambda: torch.hypot(A, B), "maximum": lambda: torch.maximum(A, B),
    "minimum": lambda: torch.minimum(A, B), "fmax": lambda: torch.fmax(A, B), "fmin": lambda: torch.fmin(A, B),
    "copysign": lambda: torch.copysign(A, B), "xlogy": lambda: torch.xlogy(A, B),
    "xlog1py": lambda: torch.special.xlog1py(A, B), "logaddexp": lambda: torch.logaddexp(A, B),
    "logaddexp2": lambda: torch.logaddexp2(A, B), "lerp": lambda: torch.lerp(A, B, 0.3),
    "heaviside": lambda: torch.heaviside(A, B), "clamp_tensor": lambda: torch.clamp(A, min=B),
    "lt": lambda: A < B, "eq": lambda: A == B, "isclose": lambda: torch.isclose(A, B),
    "softmax": lambda: torch.softmax(ROWS, -1), "log_softmax": lambda: torch.log_softmax(ROWS, -1),
    "logsumexp": lambda: torch.logsumexp(ROWS, -1), "sum": lambda: ROWS.sum(-1), "prod": lambda: ROWS.prod(-1),
    "amax": lambda: ROWS.amax(-1), "argmax": lambda: ROWS.argmax(-1), "argmin": lambda: ROWS.argmin(0),
    "sort": lambda: ROWS.sort(dim=-1, stable=True)[0], "argsort": lambda: ROWS.argsort(dim=-1, stable=True),
    "cummax": lambda: ROWS.cummax(-1)[1], "cumsum": lambda: ROWS.cumsum(-1), "nansum": lambda: ROWS.nansum(-1),
    "normalize": lambda: F.normalize(ROWS, dim=-1), "layer_norm": lambda: F.layer_norm(ROWS, (len(VALUES),)),
    "int_div_floor": lambda: torch.div(I, J, rounding_mode="floor"), "int_div_trunc": lambda: torch.div(I, J, rounding_mode="trunc"),
    "int_remainder": lambda: torch.remainder(I, J), "int_floor_divide": lambda: I // J, "int_true_divide": lambda: I / J,
    "log_ndtr": lambda: torch.special.log_ndtr(X), "ndtri": lambda: torch.special.ndtri(torch.sigmoid(X)),
    "entr": lambda: torch.special.entr(X), "erfcx": lambda: torch.special.erfcx(X),
})


def _differences(expected: torch.Tensor, actual: torch.Tensor) -> torch.Tensor:
    """Flat mask of the elements that differ."""
    e, a = expected.flatten(), actual.flatten()
    if not e.is_floating_point():
        return e != a
    e, a = e.double(), a.double()
    same = (e.isnan() & a.isnan()) | torch.isclose(e, a, rtol=1e-4, atol=1e-30)
    zero_signs = (e == 0) & (a == 0) & (e.signbit() != a.signbit())
    return ~same | zero_signs


def _inputs_at(index: int, size: int):
    if size == A.numel():
        return (A[index].item(), B[index].item())
    if size == X.numel():
        return X[index].item()
    if size == I.numel():
        return (I[index].item(), J[index].item())
    return index


def main(names: list[str]) -> int:
    warnings.simplefilter("ignore")
    differing = []
    for name, fn in CASES.items():
        if names and name not in names:
            continue
        ort_dynamo.reset()
        torch._dynamo.reset()
        expected = fn()
        try:
            actual = torch.compile(fn, backend="ort")()
        except Exception as exc:  # noqa: BLE001 (a sweep reports every failure and goes on)
            print(f"{name}: error {type(exc).__name__}: {str(exc)[:200]}")
            differing.append(name)
            continue
        fell_back = ort_dynamo.report().fallback_nodes
        if expected.shape != actual.shape or expected.dtype != actual.dtype:
            print(f"{name}: shape/dtype {tuple(expected.shape)} {expected.dtype} vs {tuple(actual.shape)} {actual.dtype}")
            differing.append(name)
            continue
        mask = _differences(expected, actual)
        if mask.any():
            where = mask.nonzero().flatten()[:4].tolist()
            print(f"{name}: {int(mask.sum())} differ (fallback nodes {fell_back}); at "
                  + ", ".join(f"{_inputs_at(k, expected.numel())}: eager {expected.flatten()[k].item()} "
                              f"ort {actual.flatten()[k].item()}" for k in where))
            differing.append(name)
    print(f"{len(differing)} op(s) differ: {' '.join(differing)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
