"""Replacements for torchlib lowerings that fail in ORT or give wrong values on corner cases
(sizes that are not 1, negative zero, negative padding, ORT's output_padding limit)."""

from __future__ import annotations

import math
from typing import Optional, Sequence

import onnx_ir as ir
import torch
from onnxscript.function_libs.torch_lib.ops import core as torchlib_core
from onnxscript.function_libs.torch_lib.ops import nn as torchlib_nn
from onnxscript import INT64
from onnxscript.onnx_opset import opset18 as op

aten = torch.ops.aten

_FLOATS = {ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.FLOAT16, ir.DataType.BFLOAT16}
_INT64 = 7


def _ints(*values) -> ir.Value:
    return op.Constant(value_ints=list(values))


def _number(value) -> bool:
    """A Python number (not a symbolic value, which dispatch also hands to a float parameter)."""
    return isinstance(value, (bool, int, float))


def _scalar_like(value, like):
    """The Python number ``value`` as a constant of ``like``'s dtype, made in that dtype:
    ``op.CastLike(value, like)`` makes a float32 constant first, which loses a float64
    graph's digits (0.1 -> 0.10000000149)."""
    if like.dtype is None or not _number(value):
        return op.CastLike(value, like)
    return op.Constant(value=ir.tensor(value, dtype=like.dtype))


def _squeezable(self, dims: Sequence[int]) -> list[int] | None:
    """The dims of ``dims`` torch really squeezes (those of size 1); None if the shape is unknown.
    A symbolic size is kept: an input's is never 1 (torch specializes sizes 0 and 1), and one
    that is 1 by a guard (``n // 8``) was made a select before export (``lower.squeezes_as_traced``)."""
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


def _with_sign_of(value, reference, floating: bool = True):
    """|value| with ``reference``'s sign bit (copysign), also for results whose sign is the
    reference's, zeros included. A factor of -1/+1, not Where(sign, -|x|, |x|): ORT's Where
    turns a -0.0 it selects from its first branch into +0.0."""
    sign = op.Where(_sign_bit(reference, floating), _scalar_like(-1.0, value), _scalar_like(1.0, value))
    return op.Mul(op.Abs(value), sign)


def aten_sign(self):
    """sign(Tensor self): torch's sign is 0 for NaN and +0.0 for -0.0; ONNX Sign returns NaN
    for NaN. For floats, (x > 0) - (x < 0), as torch computes it."""
    if self.dtype == ir.DataType.BOOL:
        return op.Identity(self)
    if self.dtype not in _FLOATS:
        return op.Sign(self)
    zero = _scalar_like(0.0, self)
    return op.Sub(op.CastLike(op.Greater(self, zero), self), op.CastLike(op.Less(self, zero), self))


def aten_heaviside(self, values):
    """heaviside(Tensor self, Tensor values): ``values`` where self is 0, else (self > 0), so a
    NaN gives 0 as in torch (torchlib's ``self < 0 ? 0 : 1`` gives 1)."""
    zero = _scalar_like(0.0, self)
    return op.Where(op.Equal(self, zero), values, op.CastLike(op.Greater(self, zero), self))


def aten_signbit(self):
    """signbit(Tensor self) -> Tensor."""
    if self.dtype == ir.DataType.BOOL:
        return op.Equal(self, op.Not(self))  # all False, of self's shape
    return _sign_bit(self, self.dtype in _FLOATS)


def aten_copysign(self, other):
    """copysign.Tensor(Tensor self, Tensor other): |self| with ``other``'s sign bit. (torch
    would decompose it through prims.signbit, whose fake tensor is float, not bool.)"""
    # no -0 in integers: an integer ``other`` is compared as it is (type promotion made self a float)
    return _with_sign_of(self, other, floating=other.dtype in _FLOATS)


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


# -- scalars, clamps, divisions and remainders --------------------------------------------------

def aten_scalar_tensor(s: float, dtype: int = 1, layout: str = "", device: str = "",
                       pin_memory: bool = False):
    """scalar_tensor(Scalar s, *, ScalarType? dtype=None, ...): a constant made in ``dtype``.
    torchlib makes a float32 constant and casts it, and the type promotion turns every Python
    scalar of a float64 graph into one of these: ``x * 0.1`` computed ``x * float32(0.1)``,
    1.5e-8 off. A symbolic ``s`` (a SymFloat input) is torchlib's case."""
    if not _number(s):
        return torchlib_core.aten_scalar_tensor(s, dtype=dtype)
    return _fill_value(s, 1 if dtype == -1 else dtype)


def _fill_value(value, dtype: int, like=None):
    """The number ``value`` as a constant of ONNX ``dtype``, or of ``like``'s dtype for -1."""
    if dtype == -1:
        return _scalar_like(value, like)
    return op.Constant(value=ir.tensor(value, dtype=ir.DataType(dtype)))


# The fills below are torchlib's, with the fill value made in the result's dtype (see
# aten_scalar_tensor); a symbolic value takes torchlib's way.

def aten_full(size: INT64, fill_value: float, dtype: int = -1, layout: str = "", device: str = "",
              pin_memory: bool = False):
    """full(SymInt[] size, Scalar fill_value, *, ScalarType? dtype=None, ...)."""
    if dtype == -1 or not _number(fill_value):
        return torchlib_core.aten_full(size, fill_value, dtype=dtype)
    return op.Expand(_fill_value(fill_value, dtype), op.Cast(size, to=_INT64))


def aten_full_like(self, fill_value: float, dtype: int = -1, layout: str = "", device: str = "",
                   pin_memory: bool = False, memory_format: str = ""):
    """full_like(Tensor self, Scalar fill_value, *, ScalarType? dtype=None, ...)."""
    if dtype != -1 and not _number(fill_value):
        return torchlib_core.aten_full_like(self, fill_value, dtype=dtype)
    return op.Expand(_fill_value(fill_value, dtype, self), op.Shape(self))


def aten_new_full(self, size: INT64, fill_value: float, dtype: int = -1, layout: str = "",
                  device: str = "", pin_memory: bool = False):
    """new_full(Tensor self, SymInt[] size, Scalar fill_value, *, ScalarType? dtype=None, ...)."""
    if dtype != -1 and not _number(fill_value):
        return torchlib_core.aten_new_full(self, size, fill_value, dtype=dtype)
    return op.Expand(_fill_value(fill_value, dtype, self), op.Cast(size, to=_INT64))


def aten_fill_scalar(self, value: float):
    """fill.Scalar(Tensor self, Scalar value)."""
    return op.Expand(_scalar_like(value, self), op.Shape(self))


def aten_masked_fill_scalar(self, mask, value: float):
    """masked_fill.Scalar(Tensor self, Tensor mask, Scalar value)."""
    return op.Where(mask, _scalar_like(value, self), self)


def aten_clamp(self, min: Optional[float] = None, max: Optional[float] = None):
    """clamp(Tensor self, Scalar? min=None, Scalar? max=None): ORT's Clip with one bound
    missing clips to the type's largest value, so +inf came out as 3.4e38. One bound is a
    Max or Min (which keep inf and NaN, as torch)."""
    if min is not None and max is not None:
        return op.Clip(self, _scalar_like(min, self), _scalar_like(max, self))
    if min is not None:
        return aten_clamp_min(self, min)
    if max is not None:
        return aten_clamp_max(self, max)
    return op.Identity(self)


def aten_clamp_min(self, min: float):
    """clamp_min(Tensor self, Scalar min) (see aten_clamp)."""
    return op.Max(self, _scalar_like(min, self))


def aten_clamp_max(self, max: float):
    """clamp_max(Tensor self, Scalar max) (see aten_clamp)."""
    return op.Min(self, _scalar_like(max, self))


def aten_clamp_min_tensor(self, min):
    """clamp_min.Tensor (a float64 graph's scalar bound becomes a tensor; see aten_clamp)."""
    return op.Max(self, op.CastLike(min, self))


def aten_clamp_max_tensor(self, max):
    """clamp_max.Tensor (see aten_clamp)."""
    return op.Min(self, op.CastLike(max, self))


def aten_hardtanh_backward(grad_output, self, min_val: float, max_val: float):
    """hardtanh_backward: no gradient at or beyond either bound, as ATen's kernel
    (``self <= min_val || self >= max_val``). torchlib let it through at the bounds themselves
    (ReLU6's 0 and 6: a silently different gradient) and multiplied by float32 masks (a
    float16 or float64 graph failed in ORT)."""
    outside = op.Or(op.LessOrEqual(self, _scalar_like(min_val, self)),
                    op.GreaterOrEqual(self, _scalar_like(max_val, self)))
    return op.Where(outside, _scalar_like(0.0, grad_output), grad_output)


def _floor_divide(self, other):
    """torch's floor division. Integers: exact int64 division (torchlib divided in float32,
    wrong beyond 2**24), rounded down; ORT reports a zero divisor as an error, as torch does.
    Floats: c10's div_floor_floating, from fmod, so that 1 // 0.1 is 9 (not floor(1 / 0.1) =
    10) and inf // 1 is NaN, as in eager."""
    if self.dtype not in _FLOATS:
        quotient = op.Div(self, other)
        rest = op.Sub(self, op.Mul(quotient, other))
        zero = _scalar_like(0, self)
        inexact_negative = op.And(op.Not(op.Equal(rest, zero)),
                                  op.Xor(op.Less(rest, zero), op.Less(other, zero)))
        return op.Sub(quotient, op.CastLike(inexact_negative, self))
    zero = _scalar_like(0.0, self)
    mod = op.Mod(self, other, fmod=1)
    div = op.Div(op.Sub(self, mod), other)
    div = op.Sub(div, op.CastLike(op.And(op.Not(op.Equal(mod, zero)),
                                         op.Xor(op.Less(other, zero), op.Less(mod, zero))), self))
    floored = op.Floor(div)
    half = _scalar_like(0.5, self)
    floored = op.Add(floored, op.CastLike(op.Greater(op.Sub(div, floored), half), self))
    quotient = op.Div(self, other)
    result = op.Where(op.Equal(other, zero), quotient, floored)
    return _with_sign_of(result, quotient)  # a zero quotient keeps a / b's sign, as in torch


def _trunc_divide(self, other):
    """torch's truncating division: exact for integers (see _floor_divide); floats as
    torchlib (the sign of a zero quotient kept)."""
    if self.dtype not in _FLOATS:
        return op.Div(self, other)
    return _trunc(op.Div(self, other))


def _trunc(x):
    """Rounded toward zero, keeping the sign of a zero result (trunc(-0.5) = -0.0)."""
    return _with_sign_of(op.Floor(op.Abs(x)), x)


def aten_trunc(self):
    """trunc(Tensor self) (torchlib lost the sign of -0.0 and of trunc(-0.5))."""
    return _trunc(self) if self.dtype in _FLOATS else op.Identity(self)


def aten_frac(self):
    """frac(Tensor self): x - trunc(x), as torch (0.0 for -0.0)."""
    return op.Sub(self, _trunc(self))


def aten_div_mode(self, other, rounding_mode: Optional[str] = None):
    """div.Tensor_mode / div.Scalar_mode(Tensor self, other, *, str? rounding_mode)."""
    if rounding_mode == "floor":
        return _floor_divide(self, other)
    if rounding_mode == "trunc":
        return _trunc_divide(self, other)
    return torchlib_core.aten_div_mode(self, other, rounding_mode=rounding_mode)


def aten_div_scalar_mode(self, other: float, rounding_mode: Optional[str] = None):
    return aten_div_mode(self, _scalar_like(other, self), rounding_mode=rounding_mode)


def aten_floor_divide(self, other):
    """floor_divide(Tensor self, Tensor other) (see _floor_divide)."""
    return _floor_divide(self, other)


def aten_remainder(self, other):
    """remainder.Tensor(Tensor self, Tensor other): for floats, fmod moved to the divisor's
    sign, as torch computes it (torchlib's a - floor(a / b) * b gives 0 for 1 % 0.1, torch
    0.09999; and NaN for 0 % inf, torch 0)."""
    if self.dtype not in _FLOATS:
        return op.Mod(self, other)
    zero = _scalar_like(0.0, self)
    mod = op.Mod(self, other, fmod=1)
    moved = op.And(op.Not(op.Equal(mod, zero)), op.Xor(op.Less(other, zero), op.Less(mod, zero)))
    # mod + (moved ? other : 0) would turn a -0.0 remainder into +0.0; Where's else branch keeps it
    return op.Where(op.Not(moved), mod, op.Add(mod, other))


def aten_remainder_scalar(self, other: float):
    return aten_remainder(self, _scalar_like(other, self))


# -- functions that lose accuracy or special values as torchlib writes them ----------------------

def _log1p(x):
    """log(1 + x) to a few ulp near 0 (Goldberg: log(u) * x / (u - 1) with u = 1 + x);
    torchlib's Log(1 + x) was 5% off at x = 1e-6."""
    one = _scalar_like(1.0, x)
    u = op.Add(one, x)
    scaled = op.Div(op.Mul(op.Log(u), x), op.Sub(u, one))
    result = op.Where(op.Equal(u, one), x, scaled)
    result = op.Where(op.IsInf(x, detect_negative=0), x, result)
    return _with_sign_of(result, x)  # log1p(-0.0) = -0.0


def aten_log1p(self):
    """log1p(Tensor self) (see _log1p)."""
    return _log1p(self)


def aten_expm1(self):
    """expm1(Tensor self): exp(x) - 1 to a few ulp near 0 (Kahan: (u - 1) * x / log(u) with
    u = exp(x)); torchlib's Exp(x) - 1 was 5% off at x = 1e-6 and 0 for tiny x."""
    one = _scalar_like(1.0, self)
    u = op.Exp(self)
    less_one = op.Sub(u, one)
    scaled = op.Div(op.Mul(less_one, self), op.Log(u))
    result = op.Where(op.Equal(less_one, op.Neg(one)), less_one, scaled)
    result = op.Where(op.Equal(u, one), self, result)
    result = op.Where(op.IsInf(u, detect_negative=0), u, result)
    return _with_sign_of(result, self)  # expm1(-0.0) = -0.0


def aten_xlogy(self, other):
    """xlogy.Tensor(Tensor self, Tensor other): NaN where ``other`` is NaN, else 0 where
    ``self`` is 0 (torchlib gave 0 for xlogy(0, nan))."""
    zero = _scalar_like(0.0, self)
    result = op.Where(op.Equal(self, zero), zero, op.Mul(self, op.Log(other)))
    return op.Where(op.IsNaN(other), other, result)


def _log_add_exp(self, other, base2: bool):
    """log(e^a + e^b) as torch computes it: max + log1p(e^-|a - b|), so that neither exp
    overflows (torchlib's Log(Exp(a) + Exp(b)) gave inf for logaddexp(-inf, 1e30)); equal
    infinities return themselves."""
    high = op.Max(self, other)
    gap = op.Neg(op.Abs(op.Sub(self, other)))
    if base2:
        two = _scalar_like(2.0, self)
        inv_ln2 = _scalar_like(1.0 / math.log(2.0), self)
        result = op.Add(high, op.Mul(_log1p(op.Pow(two, gap)), inv_ln2))
    else:
        result = op.Add(high, _log1p(op.Exp(gap)))
    same_infinity = op.And(op.IsInf(self), op.Equal(self, other))
    return op.Where(same_infinity, self, result)


def aten_logaddexp(self, other):
    return _log_add_exp(self, other, base2=False)


def aten_logaddexp2(self, other):
    return _log_add_exp(self, other, base2=True)


def aten_atan2(self, other):
    """atan2(Tensor self, Tensor other), y = self, x = other. torchlib maps every NaN to 0
    (for atan2(0, 0)), so atan2(nan, 1) was 0, and atan2(inf, inf) 0 (torch: pi/4). Here:
    atan(y / x), moved by +-pi (y's sign) where x has its sign bit; both zero gives +-0 or
    +-pi, both infinite +-pi/4 or +-3pi/4; NaN stays NaN."""
    y, x = self, other

    def const(value):
        return _scalar_like(value, y)  # pi in float64 graphs to float64's digits

    y_negative, x_negative = _sign_bit(y, True), _sign_bit(x, True)
    half_turn = op.Where(y_negative, const(-math.pi), const(math.pi))
    angle = op.Atan(op.Div(y, x))
    angle = op.Where(x_negative, op.Add(angle, half_turn), angle)
    zero = const(0.0)
    both_zero = op.And(op.Equal(y, zero), op.Equal(x, zero))
    angle = op.Where(both_zero, op.Where(x_negative, const(math.pi), zero), angle)
    corner = op.Where(x_negative, const(3 * math.pi / 4), const(math.pi / 4))
    angle = op.Where(op.And(op.IsInf(y), op.IsInf(x)), corner, angle)
    return _with_sign_of(angle, y)  # the angle has y's sign, zeros included


def aten_logcumsumexp(self, dim: int):
    """logcumsumexp(Tensor self, int dim): log(cumsum(exp(x - m))) + m, with m the largest
    number along ``dim``. torchlib's m is the plain max, NaN once a NaN is anywhere along
    ``dim`` (ReduceMax propagates NaN here, see rewrite.py): every entry turned NaN, not only
    those from the NaN on; an infinite m is replaced by 0 (x - inf would be NaN)."""
    if self.shape is not None and len(self.shape) == 0:
        return op.Identity(self)
    zero = _scalar_like(0.0, self)
    numbers = op.Where(op.IsNaN(self), _scalar_like(-math.inf, self), self)
    shift = op.ReduceMax(numbers, _ints(dim), keepdims=1)
    shift = op.Where(op.IsInf(shift), zero, shift)
    total = op.CumSum(op.Exp(op.Sub(self, shift)), op.Constant(value_int=dim))
    return op.Add(op.Log(total), shift)


def aten_sinc(self):
    """sinc(Tensor self): sin(pi x) / (pi x), 1 at 0, with pi in the input's dtype (torchlib's
    pi is a float32 constant: float64 sinc(1) was -2.8e-8, torch 3.9e-17)."""
    pi_x = op.Mul(self, _scalar_like(math.pi, self))
    return op.Where(op.Equal(self, _scalar_like(0.0, self)), _scalar_like(1.0, self), op.Div(op.Sin(pi_x), pi_x))


def aten_pow_tensor_scalar(self, exponent: float):
    """pow.Tensor_Scalar: torch computes x ** 0.5 as sqrt and x ** -0.5 as rsqrt, so
    (-inf) ** 0.5 is NaN and (-0.0) ** 0.5 is -0.0 (C's pow: inf and +0.0)."""
    if self.dtype in _FLOATS and exponent == 0.5:
        return op.Sqrt(self)
    if self.dtype in _FLOATS and exponent == -0.5:
        return op.Reciprocal(op.Sqrt(self))
    return torchlib_core.aten_pow_tensor_scalar(self, exponent)


LOWERINGS = {
    aten.squeeze.dim: aten_squeeze_dim,
    aten.squeeze.dims: aten_squeeze_dims,
    aten.signbit.default: aten_signbit,
    aten.sign.default: aten_sign,
    aten.sgn.default: aten_sign,
    aten.heaviside.default: aten_heaviside,
    aten.scalar_tensor.default: aten_scalar_tensor,
    aten.full.default: aten_full,
    aten.full_like.default: aten_full_like,
    aten.new_full.default: aten_new_full,
    aten.fill.Scalar: aten_fill_scalar,
    aten.masked_fill.Scalar: aten_masked_fill_scalar,
    aten.hardtanh_backward.default: aten_hardtanh_backward,
    aten.clamp.default: aten_clamp,
    aten.clamp_min.default: aten_clamp_min,
    aten.clamp_max.default: aten_clamp_max,
    aten.clamp_min.Tensor: aten_clamp_min_tensor,
    aten.clamp_max.Tensor: aten_clamp_max_tensor,
    aten.div.Tensor_mode: aten_div_mode,
    aten.div.Scalar_mode: aten_div_scalar_mode,
    aten.floor_divide.default: aten_floor_divide,
    aten.remainder.Tensor: aten_remainder,
    aten.remainder.Scalar: aten_remainder_scalar,
    aten.log1p.default: aten_log1p,
    aten.expm1.default: aten_expm1,
    aten.xlogy.Tensor: aten_xlogy,
    aten.logaddexp.default: aten_logaddexp,
    aten.logaddexp2.default: aten_logaddexp2,
    aten.atan2.default: aten_atan2,
    aten.pow.Tensor_Scalar: aten_pow_tensor_scalar,
    aten.trunc.default: aten_trunc,
    aten.sinc.default: aten_sinc,
    aten.special_sinc.default: aten_sinc,
    aten.logcumsumexp.default: aten_logcumsumexp,
    aten.frac.default: aten_frac,
    aten.copysign.Tensor: aten_copysign,
    aten.copysign.Scalar: aten_copysign_scalar,
    aten.convolution.default: aten_convolution,
    aten.replication_pad1d.default: aten_replication_pad1d,
    aten.replication_pad2d.default: aten_replication_pad2d,
    aten.replication_pad3d.default: aten_replication_pad3d,
}
