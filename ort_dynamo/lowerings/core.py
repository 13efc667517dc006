"""Lowerings that replace wrong torchlib ones (mv, dot, bernoulli, max pooling's NaN), add small
missing ones, export faster than torchlib's (view) or run faster (unfold, max pooling's indices)."""

from __future__ import annotations

from typing import Sequence

import onnx_ir as ir
import torch
from onnxscript import INT64
from onnxscript.function_libs.torch_lib.ops import core as torchlib_core
from onnxscript.function_libs.torch_lib.ops import nn as torchlib_nn
from onnxscript.function_libs.torch_lib.tensor_typing import TReal
from onnxscript.onnx_opset import opset18 as op

from .fixes import _FLOATS, _ints

aten = torch.ops.aten

#: torchlib lowerings that give wrong values; without them the op is decomposed by torch or
#: stays in PyTorch. (Complex results are refused by export's ``_fix_for_torchlib``.)
REMOVED_LOWERINGS = (
    "aten::special_erfcx",  # off by up to 0.13 for x < 0 (ORT 1.31, onnxscript 0.7.2)
)


def aten_mv(self: TReal, vec: TReal) -> TReal:
    """mv(Tensor self, Tensor vec) -> Tensor, with ``vec`` as a column.

    ORT 1.31's extended optimizer (MatMul+Transpose fusion) computes ``MatMul(Transpose(A), v)``
    wrongly when ``v`` is 1-D, which is what every ``mv`` backward emits; a 2-D MatMul is safe.
    """
    column = op.Unsqueeze(vec, op.Constant(value_ints=[-1]))
    return op.Squeeze(op.MatMul(self, column), op.Constant(value_ints=[-1]))


def aten_dot(self: TReal, tensor: TReal) -> TReal:
    """dot(Tensor self, Tensor tensor) -> Tensor, as a (1, n) x (n, 1) product (see aten_mv)."""
    row = op.Unsqueeze(self, op.Constant(value_ints=[0]))
    column = op.Unsqueeze(tensor, op.Constant(value_ints=[-1]))
    return op.Squeeze(op.MatMul(row, column))


def aten_sort_stable(self: TReal, stable: bool = False, dim: int = -1,
                     descending: bool = False) -> tuple[TReal, INT64]:
    """sort.stable(Tensor self, *, bool? stable, int dim=-1, bool descending=False).

    ONNX TopK breaks ties by the lower index, so a full-length TopK is a stable sort.
    """
    return torchlib_core.aten_sort(self, dim=dim, descending=descending)


def aten_bernoulli(self: TReal) -> TReal:
    """bernoulli(Tensor self, *, Generator? generator=None): 1 with probability ``self``.

    ORT 1.31's Bernoulli kernel returns 1 with probability ``1 - p`` (the inverse of the
    ONNX spec), so sample by comparing a uniform draw instead. ORT's RNG, not PyTorch's:
    values differ from eager, the distribution does not.
    """
    uniform = op.RandomUniformLike(op.Cast(self, to=1), low=0.0, high=1.0)
    return op.CastLike(op.Less(uniform, op.Cast(self, to=1)), self)


def aten_view(self: TReal, size: Sequence[INT64]) -> TReal:
    """view(Tensor(a) self, SymInt[] size): a static shape as one constant. torchlib builds
    every shape from one Constant per dim and a Concat (folded later, but each op costs
    export time: views are a sixth of a transformer's nodes)."""
    if all(isinstance(d, int) for d in size):
        return op.Reshape(self, op.Constant(value_ints=list(size)), allowzero=True)
    return torchlib_core.aten_view(self, size)


def prims_view_of(self: TReal) -> TReal:
    """prims.view_of(Tensor a): a view with the same values (squeeze of several dims emits it)."""
    return op.Identity(self)


def aten_slice_copy(self: TReal, dim: int = 0, start: INT64 | None = None, end: INT64 | None = None,
                    step: INT64 = 1) -> TReal:
    """slice_copy.Tensor: a slice as a new tensor, which ``decompositions`` writes where a view
    of a symbolic length would make Dynamo guard on its layout. For ONNX, a Slice either way."""
    return torchlib_core.aten_slice(self, dim, start, end, step)


def aten_unfold(self: TReal, dimension: int, size: int, step: int) -> TReal:
    """unfold(Tensor(a) self, int dimension, int size, int step): the windows as slices of the
    input cut into rows of ``step``, not torchlib's Gather with an index per element (2-7x
    eager's time, benchmarks/layer_ops.py). Window ``w``'s element ``j`` is position
    ``w * step + j``: block ``b`` of ``step`` elements of every window is row ``w + b``."""
    shape = list(self.shape) if self.shape is not None else []
    if not shape or 0 in shape or step <= 0 or size <= 0:
        return torchlib_core.aten_unfold(self, dimension, size, step)
    rank, dim = len(shape), dimension % len(shape)
    blocks = -(-size // step)
    if isinstance(shape[dim], int) and sum(not isinstance(d, int) for d in shape) <= 1:
        windows = (shape[dim] - size) // step + 1
        rows = windows + blocks - 1
        x = self
        if rows * step > shape[dim]:  # the last block's zeros are never read
            x = op.Pad(x, op.Constant(value_ints=_pads_at_end(rank, dim, rows * step - shape[dim])))
        elif rows * step < shape[dim]:
            x = op.Slice(x, _ints(0), _ints(rows * step), _ints(dim))
        sizes = [d if isinstance(d, int) else -1 for d in shape]
        x = op.Reshape(x, op.Constant(value_ints=sizes[:dim] + [rows, step] + sizes[dim + 1:]), allowzero=True)
        ends = [_ints(b + windows) for b in range(blocks)]
    else:  # symbolic sizes (dynamic=True: a signal's length): the same from the input's shape
        windows = op.Add(op.Div(op.Sub(op.Shape(self, start=dim, end=dim + 1), _ints(size)), _ints(step)), _ints(1))
        rows = op.Add(windows, _ints(blocks - 1))
        # rows * step <= length - size + blocks * step: that many zeros at most are missing
        x = self if blocks * step == size else \
            op.Pad(self, op.Constant(value_ints=_pads_at_end(rank, dim, blocks * step - size)))
        x = op.Slice(x, _ints(0), op.Mul(rows, _ints(step)), _ints(dim))
        x = op.Reshape(x, op.Concat(op.Shape(self, start=0, end=dim), rows, _ints(step),
                                    op.Shape(self, start=dim + 1), axis=0))
        ends = [op.Add(windows, _ints(b)) for b in range(blocks)]
    if blocks > 1:
        x = op.Concat(*[op.Slice(x, _ints(b), end, _ints(dim)) for b, end in enumerate(ends)], axis=dim + 1)
    if blocks * step != size:
        x = op.Slice(x, _ints(0), _ints(size), _ints(dim + 1))
    if dim + 1 < rank:  # the window's elements go last
        perm = list(range(rank + 1))
        perm.append(perm.pop(dim + 1))
        x = op.Transpose(x, perm=perm)
    return x


def _pads_at_end(rank: int, dim: int, count: int) -> list[int]:
    pads = [0] * (2 * rank)
    pads[rank + dim] = count
    return pads


def _max_pool_with_indices(spatial: int):
    """max_pool{1,2,3}d_with_indices: ONNX MaxPool numbers its indices across the whole tensor,
    torch within each (n, c) plane. torchlib finds each plane's first number by running a second
    MaxPool (kernel 1) over the whole input, as long as the pooling itself; the first number of
    plane p is p times the plane's size, which a Range computes from the shape."""
    def lowering(self, kernel_size: Sequence[int], stride: Sequence[int] = (), padding: Sequence[int] = (0,) * spatial,
                 dilation: Sequence[int] = (1,) * spatial, ceil_mode: bool = False):
        kernels, strides, pads, dilations = torchlib_nn._adjust_attributes_of_max_pool(
            spatial, kernel_size, stride, padding, dilation)
        unbatched = len(self.shape) == spatial + 1
        x = op.Unsqueeze(self, _ints(0)) if unbatched else self
        pooled, indices = op.MaxPool(x, ceil_mode=ceil_mode, dilations=dilations, kernel_shape=kernels,
                                     pads=pads, strides=strides)
        shape = op.Shape(x)
        lead, plane = op.Slice(shape, _ints(0), _ints(2)), op.Slice(shape, _ints(2), _ints(2 + spatial))
        plane_size = op.ReduceProd(plane, keepdims=False)
        first = op.Mul(op.Range(op.Constant(value_int=0), op.ReduceProd(lead, keepdims=False),
                                op.Constant(value_int=1)), plane_size)
        indices = op.Sub(indices, op.Reshape(first, op.Concat(lead, _ints(*[1] * spatial), axis=0)))
        if self.dtype in _FLOATS:
            pooled, indices = _nan_as_torch(x, pooled, indices, plane_size, plane,
                                            dict(ceil_mode=ceil_mode, dilations=dilations, kernel_shape=kernels,
                                                 pads=pads, strides=strides))
        if unbatched:
            pooled, indices = op.Squeeze(pooled, _ints(0)), op.Squeeze(indices, _ints(0))
        return pooled, indices

    lowering.__name__ = f"aten_max_pool{spatial}d_with_indices"
    return lowering


def _nan_as_torch(x, pooled, indices, plane_size, plane, attributes: dict):
    """ORT's MaxPool skips NaN; torch's takes it (each NaN in a window replaces the maximum so
    far): the value is NaN and the index the window's last NaN in row-major order. A second
    MaxPool, over each NaN's position plus one (float32, 0 elsewhere), finds that NaN."""
    positions = op.Cast(op.Range(op.Constant(value_int=1), op.Add(plane_size, op.Constant(value_int=1)),
                                 op.Constant(value_int=1)), to=ir.DataType.FLOAT)
    positions = op.Reshape(positions, plane)
    # Cast and Mul, not Where: ORT's Where broadcasts in a generic loop, four times slower here.
    last_nan, _ = op.MaxPool(op.Mul(op.Cast(op.IsNaN(x), to=ir.DataType.FLOAT), positions), **attributes)
    has_nan = op.Greater(last_nan, op.Constant(value_float=0.0))
    nan = op.CastLike(op.Constant(value_float=float("nan")), pooled)
    index = op.Sub(op.Cast(last_nan, to=ir.DataType.INT64), op.Constant(value_int=1))
    return op.Where(has_nan, nan, pooled), op.Where(has_nan, index, indices)


LOWERINGS = {
    torch.ops.prims.view_of.default: prims_view_of,
    aten.bernoulli.default: aten_bernoulli,
    aten.mv.default: aten_mv,
    aten.dot.default: aten_dot,
    aten.sort.stable: aten_sort_stable,
    aten.view.default: aten_view,
    aten._unsafe_view.default: aten_view,
    aten.unfold.default: aten_unfold,
    aten.slice_copy.Tensor: aten_slice_copy,
    **{getattr(aten, f"max_pool{n}d_with_indices").default: _max_pool_with_indices(n) for n in (1, 2, 3)},
}

