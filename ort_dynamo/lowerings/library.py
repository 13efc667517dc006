"""Lowerings of other libraries' custom ops. They exist only once the library has defined them
(``torch.library``), so ``register_library_ops`` adds each lowering when its op is there.

transformers' mixture-of-experts layers (Mixtral, Qwen-MoE, ...) multiply each expert's rows by
its weight with ``transformers::grouped_mm_fallback`` wherever ``torch._grouped_mm`` is not used
(CPU, float32): a loop in Python, opaque to the tracer. Here each expert is a Slice of the rows
that ``offs`` (cumulative row counts, rows sorted by expert) gives it and one MatMul; experts are
few and fixed by the weight's shape, rows per expert are data.
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.onnx_opset import opset18 as op

from .fixes import _ints


def _expert_rows(ends, i: int, *tensors):
    """Rows ``[ends[i-1], ends[i])`` (from 0 for the first expert) of each tensor."""
    start = _ints(0) if i == 0 else op.Slice(ends, _ints(i - 1), _ints(i))
    end = op.Slice(ends, _ints(i), _ints(i + 1))
    return [op.Slice(t, start, end, _ints(0)) for t in tensors]


def _experts(weight) -> int:
    experts = weight.shape[0]
    if not isinstance(experts, int):
        raise NotImplementedError("grouped_mm: the number of experts must be static")
    return experts


def _rows_then_zeros(pieces: list, like):
    """The experts' rows in order, then zeros up to ``like``'s row count (rows past the last
    offset belong to no expert; transformers' op leaves them zero)."""
    rows = op.Concat(*pieces, axis=0)
    missing = op.Sub(op.Shape(like, start=0, end=1), op.Shape(rows, start=0, end=1))
    return op.Pad(rows, op.Concat(_ints(0, 0), missing, _ints(0), axis=0))


def transformers_grouped_mm(input, weight, offs):
    """grouped_mm_fallback(Tensor input, Tensor weight, Tensor offs) -> Tensor:
    input (S, K) sorted by expert, weight (E, K, N), offs (E,) cumulative row counts."""
    ends = op.Cast(offs, to=ir.DataType.INT64)
    pieces = []
    for i in range(_experts(weight)):
        (rows,) = _expert_rows(ends, i, input)
        pieces.append(op.MatMul(rows, op.Gather(weight, op.Constant(value_int=i), axis=0)))
    return _rows_then_zeros(pieces, input)


def transformers_grouped_mm_backward(input, weight, offs, grad_output):
    """grouped_mm_fallback_backward(input, weight, offs, grad_output) -> (grad_input, grad_weight).
    An expert without rows gets a zero weight gradient (a product over zero rows)."""
    ends = op.Cast(offs, to=ir.DataType.INT64)
    grad_rows, grad_weights = [], []
    for i in range(_experts(weight)):
        rows, grads = _expert_rows(ends, i, input, grad_output)
        expert = op.Gather(weight, op.Constant(value_int=i), axis=0)
        grad_rows.append(op.MatMul(grads, op.Transpose(expert, perm=[1, 0])))
        grad_weights.append(op.Unsqueeze(op.MatMul(op.Transpose(rows, perm=[1, 0]), grads), _ints(0)))
    return _rows_then_zeros(grad_rows, input), op.Concat(*grad_weights, axis=0)


#: "namespace::name" (overload ``default``) -> lowering; ``lower._overload`` finds the op once defined.
LOWERINGS = {
    "transformers::grouped_mm_fallback": transformers_grouped_mm,
    "transformers::grouped_mm_fallback_backward": transformers_grouped_mm_backward,
}
