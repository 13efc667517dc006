"""Replacements for torchlib lowerings that fail in ORT or give wrong values on corner cases
(sizes that are not 1, negative zero, negative padding, ORT's output_padding limit)."""

from __future__ import annotations

import math
from typing import Sequence

import onnx_ir as ir
import torch
from onnxscript.function_libs.torch_lib.ops import core as torchlib_core
from onnxscript.function_libs.torch_lib.ops import nn as torchlib_nn
from onnxscript.onnx_opset import opset18 as op

aten = torch.ops.aten

_FLOATS = {ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.FLOAT16, ir.DataType.BFLOAT16}
_INT64 = 7


def _ints(*values) -> ir.Value:
    return op.Constant(value_ints=list(values))


def _squeezable(self, dims: Sequence[int]) -> list[int] | None:
    """The dims of ``dims`` torch really squeezes (those of size 1); None if the shape is unknown.
    A symbolic size is never 1 (torch specializes sizes 0 and 1), so it is never squeezed."""
    shape = self.shape
    if shape is None:
        return None
    rank = len(shape)
    return sorted({d % rank for d in dims if isinstance(shape[d % rank], int) and shape[d % rank] == 1})


def aten_squeeze_dim(self, dim: int):
    """squeeze.dim(Tensor(a) self, int dim): a no-op on a dim whose size is not 1 (ONNX
    Squeeze fails there, torchlib emits it regardless)."""
    return aten_squeeze_dims(self, [dim])


def aten_squeeze_dims(self, dim: Sequence[int]):
    """squeeze.dims(Tensor(a) self, int[] dim): squeezes only the listed dims of size 1."""
    if self.shape is not None and len(self.shape) == 0:
        return op.Identity(self)
    dims = _squeezable(self, dim)
    if dims is None:
        return op.Squeeze(self, _ints(*dim))
    if not dims:
        return op.Identity(self)
    return op.Squeeze(self, _ints(*dims))


def _sign_bit(x, floating: bool):
    """True where ``x``'s sign bit is set: x < 0, and -0.0 (1 / -0.0 = -inf). torchlib's
    ``x < 0`` misses -0.0. A NaN's sign bit cannot be read without a bit cast (which opset
    18 lacks): NaNs count as positive."""
    zero = op.CastLike(op.Constant(value_float=0.0), x)
    negative = op.Less(x, zero)
    if not floating:
        return negative
    one = op.CastLike(op.Constant(value_float=1.0), x)
    negative_zero = op.And(op.Equal(x, zero), op.Less(op.Div(one, x), zero))
    return op.Or(negative, negative_zero)


def aten_sign(self):
    """sign(Tensor self): torch's sign is 0 for NaN and +0.0 for -0.0; ONNX Sign returns NaN
    for NaN. For floats, (x > 0) - (x < 0), as torch computes it."""
    if self.dtype == ir.DataType.BOOL:
        return op.Identity(self)
    if self.dtype not in _FLOATS:
        return op.Sign(self)
    zero = op.CastLike(op.Constant(value_float=0.0), self)
    return op.Sub(op.CastLike(op.Greater(self, zero), self), op.CastLike(op.Less(self, zero), self))


def aten_heaviside(self, values):
    """heaviside(Tensor self, Tensor values): ``values`` where self is 0, else (self > 0), so a
    NaN gives 0 as in torch (torchlib's ``self < 0 ? 0 : 1`` gives 1)."""
    zero = op.CastLike(op.Constant(value_float=0.0), self)
    return op.Where(op.Equal(self, zero), values, op.CastLike(op.Greater(self, zero), self))


def aten_signbit(self):
    """signbit(Tensor self) -> Tensor."""
    if self.dtype == ir.DataType.BOOL:
        return op.Equal(self, op.Not(self))  # all False, of self's shape
    return _sign_bit(self, self.dtype in _FLOATS)


def aten_copysign(self, other):
    """copysign.Tensor(Tensor self, Tensor other): |self| with ``other``'s sign bit. (torch
    would decompose it through prims.signbit, whose fake tensor is float, not bool.)"""
    magnitude = op.Abs(self)
    if other.dtype in _FLOATS:
        sign_bit = _sign_bit(other, True)
    else:  # no -0 in integers: compared as they are (type promotion made self a float)
        sign_bit = _sign_bit(other, False)
    # A factor of -1/+1, not Where(sign_bit, -|x|, |x|): ORT's Where turns -0.0 into +0.0.
    minus_one = op.CastLike(op.Constant(value_float=-1.0), self)
    one = op.CastLike(op.Constant(value_float=1.0), self)
    return op.Mul(magnitude, op.Where(sign_bit, minus_one, one))


def aten_copysign_scalar(self, other: float):
    """copysign.Scalar(Tensor self, Scalar other)."""
    magnitude = op.Abs(self)
    return op.Neg(magnitude) if math.copysign(1.0, other) < 0 else magnitude


def aten_convolution(input, weight, bias=None, stride: Sequence[int] = (1,),
                     padding: Sequence[int] = (0,), dilation: Sequence[int] = (1,),
                     transposed: bool = False, output_padding: Sequence[int] = (0,), groups: int = 1):
    """convolution(...): torchlib's, except a transposed convolution whose ``output_padding``
    is not below its stride (torch allows up to max(stride, dilation) - 1; ORT's
    ConvTranspose rejects it). ``output_padding`` only extends the output at the end, so it is
    an end crop smaller by that much, or zeros past the full output, with the bias added last."""
    spatial = len(weight.shape) - 2

    def full(values):
        values = list(values) if isinstance(values, Sequence) else [values]
        return values * spatial if len(values) == 1 else values

    stride, padding, dilation = full(stride), full(padding), full(dilation)
    output_padding = full(output_padding)
    if not transposed or all(o < s for o, s in zip(output_padding, stride)):
        return torchlib_core.aten_convolution(input, weight, bias, stride, padding, dilation,
                                              transposed, output_padding, groups)
    no_batch = len(input.shape) != len(weight.shape)
    if no_batch:
        input = op.Unsqueeze(input, _ints(0))
    crop_end = [max(p - o, 0) for p, o in zip(padding, output_padding)]
    beyond = [max(o - p, 0) for p, o in zip(padding, output_padding)]
    result = op.ConvTranspose(input, weight, strides=stride, pads=[*padding, *crop_end], group=groups,
                              dilations=dilation)
    if any(beyond):
        result = op.Pad(result, _ints(*([0] * (spatial + 2)), 0, 0, *beyond))
    if bias is not None:
        result = op.Add(result, op.Reshape(bias, _ints(-1, *([1] * spatial))))
    if no_batch:
        result = op.Squeeze(result, _ints(0))
    return result


def _replication_pad(self, padding: Sequence[int], torchlib_fn):
    """replication_padNd with negative pads (crops), which ONNX Pad's edge mode rejects: per
    padded dim, output j takes input clamp(j - left, 0, size - 1), as torch does."""
    if all(p >= 0 for p in padding):
        return torchlib_fn(self, padding)
    rank = len(self.shape)
    result = self
    for i in range(len(padding) // 2):
        dim, left, right = rank - 1 - i, padding[2 * i], padding[2 * i + 1]
        if left == 0 and right == 0:
            continue
        size = op.Squeeze(op.Shape(self, start=dim, end=dim + 1), _ints(0))
        length = op.Add(size, op.Constant(value_int=left + right))
        index = op.Sub(op.Range(op.Constant(value_int=0), length, op.Constant(value_int=1)),
                       op.Constant(value_int=left))
        index = op.Clip(index, op.Constant(value_int=0), op.Sub(size, op.Constant(value_int=1)))
        result = op.Gather(result, index, axis=dim)
    return result


def aten_replication_pad1d(self, padding: Sequence[int]):
    return _replication_pad(self, padding, torchlib_nn.aten_replication_pad1d)


def aten_replication_pad2d(self, padding: Sequence[int]):
    return _replication_pad(self, padding, torchlib_nn.aten_replication_pad2d)


def aten_replication_pad3d(self, padding: Sequence[int]):
    return _replication_pad(self, padding, torchlib_nn.aten_replication_pad3d)


LOWERINGS = {
    aten.squeeze.dim: aten_squeeze_dim,
    aten.squeeze.dims: aten_squeeze_dims,
    aten.signbit.default: aten_signbit,
    aten.sign.default: aten_sign,
    aten.sgn.default: aten_sign,
    aten.heaviside.default: aten_heaviside,
    aten.copysign.Tensor: aten_copysign,
    aten.copysign.Scalar: aten_copysign_scalar,
    aten.convolution.default: aten_convolution,
    aten.replication_pad1d.default: aten_replication_pad1d,
    aten.replication_pad2d.default: aten_replication_pad2d,
    aten.replication_pad3d.default: aten_replication_pad3d,
}
