"""Special functions (gamma family, error-function relatives, Hurwitz zeta, frexp) as ONNX graphs.

ONNX has none of them, so each is an elementwise formula: the algorithm PyTorch's CPU kernel
runs (ATen/native/Math.h, mostly Cephes), with branches as ``Where`` over every element.
Most are computed in float64 whatever the input dtype (the tail of a recurrence or a
reflection loses digits in float32) and cast back; where eager itself rounds in float32
(trigamma, erfinv) the same float32 steps are taken, so results match eager, not just the
true value. The float64 results are not float64-accurate everywhere (float32-tuned
approximations, ORT has no float64 Erf), hence ACCURATE_DTYPES: float64 inputs stay in PyTorch.
"""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir
import torch
from onnxscript import INT32
from onnxscript.function_libs.torch_lib.tensor_typing import TFloat
from onnxscript.onnx_opset import opset18 as op

aten = torch.ops.aten

_DOUBLE, _FLOAT = 11, 1
_PI = math.pi


def _d(value: float):
    """A float64 scalar constant (value_float would round it to float32)."""
    return op.Constant(value=ir.tensor(np.array(value, dtype=np.float64)))


def _f(value: float):
    return op.Constant(value=ir.tensor(np.array(value, dtype=np.float32)))


def _horner(z, coeffs, const=_d):
    """coeffs[0] * z**n + ... + coeffs[n]."""
    result = const(coeffs[0])
    for c in coeffs[1:]:
        result = op.Add(op.Mul(result, z), const(c))
    return result


def _inf(like):
    return op.CastLike(_d(math.inf), like)


def _nan(like):
    return op.CastLike(_d(math.nan), like)


def _is_integer(x):
    return op.Equal(x, op.Floor(x))


# ---- log-gamma -------------------------------------------------------------------------------

# Boost's lanczos13m53 (also in Math.h's igamma helpers): g and the rational lanczos_sum_expg_scaled,
# highest power first.
_LANCZOS_G = 6.024680040776729583740234375
_LANCZOS_NUM = (
    0.006061842346248906525783753964555936883222, 0.5098416655656676188125178644804694509993,
    19.51992788247617482847860966235652136208, 449.9445569063168119446858607650988409623,
    6955.999602515376140356310115515198987526, 75999.29304014542649875303443598909137092,
    601859.6171681098786670226533699352302507, 3481712.15498064590882071018964774556468,
    14605578.08768506808414169982791359218571, 43338889.32467613834773723740590533316085,
    86363131.28813859145546927288977868422342, 103794043.1163445451906271053616070238554,
    56906521.91347156388090791033559122686859)
_LANCZOS_DEN = (1.0, 66.0, 1925.0, 32670.0, 357423.0, 2637558.0, 13339535.0, 45995730.0,
                105258076.0, 150917976.0, 120543840.0, 39916800.0, 0.0)


def _lanczos_sum_expg_scaled(z):
    """The Lanczos rational in z (float64); in 1/z for z > 1 so that z**12 cannot overflow."""
    big = op.Greater(z, _d(1.0))
    y = op.Where(big, op.Reciprocal(z), z)
    num = op.Where(big, _horner(y, _LANCZOS_NUM[::-1]), _horner(y, _LANCZOS_NUM))
    den = op.Where(big, _horner(y, _LANCZOS_DEN[::-1]), _horner(y, _LANCZOS_DEN))
    return op.Div(num, den)


def _lgamma64(x):
    """lgamma of a float64 tensor: Lanczos for x >= 0.5, reflection below."""
    reflect = op.Less(x, _d(0.5))
    z = op.Where(reflect, op.Sub(_d(1.0), x), x)
    zgh = op.Add(z, _d(_LANCZOS_G - 0.5))
    lg = op.Add(op.Mul(op.Sub(z, _d(0.5)), op.Sub(op.Log(zgh), _d(1.0))),
                op.Log(_lanczos_sum_expg_scaled(z)))
    # sin(pi x) from the distance to the nearest integer: exact, so poles give log(pi/0) = inf
    sin_pi_x = op.Abs(op.Sin(op.Mul(_d(_PI), op.Sub(x, op.Round(x)))))
    reflected = op.Sub(op.Log(op.Div(_d(_PI), sin_pi_x)), lg)
    return op.Where(op.IsInf(x), _inf(x), op.Where(reflect, reflected, lg))


def aten_lgamma(self: TFloat) -> TFloat:
    """lgamma(Tensor self) -> Tensor"""
    return op.CastLike(_lgamma64(op.Cast(self, to=_DOUBLE)), self)


# ---- digamma / trigamma / polygamma ----------------------------------------------------------

_PSI_ASYMPTOTIC = (8.33333333333333333333E-2, -2.10927960927960927961E-2, 7.57575757575757575758E-3,
                   -4.16666666666666666667E-3, 3.96825396825396825397E-3, -8.33333333333333333333E-3,
                   8.33333333333333333333E-2)


def _digamma64(x):
    """Cephes digamma in float64: recurrence to x + 10, asymptotic series, reflection for x < 0."""
    negative = op.Less(x, _d(0.0))
    z = op.Where(negative, op.Sub(_d(1.0), x), x)
    # psi(z) = psi(z + 10) - sum 1/(z + k); at z = +-0 the k = 0 term gives eager's -+inf.
    shift = op.Reciprocal(z)
    for k in range(1, 10):
        shift = op.Add(shift, op.Reciprocal(op.Add(z, _d(float(k)))))
    w = op.Add(z, _d(10.0))
    iw2 = op.Reciprocal(op.Mul(w, w))
    tail = op.Mul(iw2, _horner(iw2, _PSI_ASYMPTOTIC))
    psi = op.Sub(op.Sub(op.Sub(op.Log(w), op.Div(_d(0.5), w)), tail), shift)
    # reflection: psi(x) = psi(1 - x) - pi / tan(pi r), r the fractional part (as eager: exact)
    r = op.Mul(_d(_PI), op.Sub(x, op.Ceil(x)))
    reflected = op.Sub(psi, op.Div(op.Mul(_d(_PI), op.Cos(r)), op.Sin(r)))
    result = op.Where(negative, reflected, psi)
    return op.Where(op.And(negative, _is_integer(x)), _nan(x), result)


def aten_digamma(self: TFloat) -> TFloat:
    """digamma(Tensor self) -> Tensor"""
    return op.CastLike(_digamma64(op.Cast(self, to=_DOUBLE)), self)


def _trigamma32(self):
    """Eager's float trigamma, step for step in float32 (its sin(pi x) rounding included)."""
    x = op.Cast(self, to=_FLOAT)
    reflect = op.Less(x, _f(0.5))
    sin_pi_x = op.Sin(op.Mul(_f(_PI), x))
    result = op.Where(reflect, op.Neg(op.Div(op.Mul(_f(_PI), _f(_PI)), op.Mul(sin_pi_x, sin_pi_x))),
                      _f(0.0))
    z = op.Where(reflect, op.Sub(_f(1.0), x), x)
    for _ in range(6):
        result = op.Add(result, op.Reciprocal(op.Mul(z, z)))
        z = op.Add(z, _f(1.0))
    ixx = op.Reciprocal(op.Mul(z, z))
    series = op.Mul(ixx, op.Sub(_f(1 / 6), op.Mul(ixx, op.Sub(_f(1 / 30), op.Mul(ixx, _f(1 / 42))))))
    series = op.Add(op.Add(_f(1.0), op.Reciprocal(op.Mul(_f(2.0), z))), series)
    result = op.Add(result, op.Div(series, z))
    return op.CastLike(op.Where(reflect, op.Neg(result), result), self)


def aten_polygamma(n: int, self: TFloat) -> TFloat:
    """polygamma(int n, Tensor self) -> Tensor: digamma, trigamma, else -(-1)^n n! zeta(n+1, x)."""
    if n == 0:
        return aten_digamma(self)
    if n == 1:
        return _trigamma32(self)
    x = op.Cast(self, to=_DOUBLE)
    scale = (1.0 if n % 2 else -1.0) * math.factorial(n)
    zeta = _zeta64(op.CastLike(_d(float(n + 1)), x), x)
    return op.CastLike(op.Mul(_d(scale), zeta), self)


# ---- Hurwitz zeta ----------------------------------------------------------------------------

_ZETA_A = (12.0, -720.0, 30240.0, -1209600.0, 47900160.0, -1.8924375803183791606e9, 7.47242496e10,
           -2.950130727918164224e12, 1.1646782814350067249e14, -4.5979787224074726105e15,
           1.8152105401943546773e17, -7.1661652561756670113e18)
_MACHEP = 1.11022302462515654042E-16
_names = iter(range(1 << 62))


def _extra_power_terms(q, neg_x, extra, total):
    """total + sum_{k=10}^{9+extra} (q + k)^neg_x elementwise, as an ONNX Scan over k.

    Only q <= 0 needs these terms (eager sums until q + k > 9), so there are max(extra)
    steps: one, masked, when no element has q <= 0. (Scan, not Loop: the exporter's tracer passes
    Loop's M and cond twice.)
    """
    def value(name, dtype, shape=None):
        return ir.Value(name=f"zeta_{name}_{next(_names)}", type=ir.TensorType(dtype),
                        shape=None if shape is None else ir.Shape(shape))

    nodes = []

    def node(op_type, *inputs, dtype=ir.DataType.DOUBLE, **attributes):
        out = value(op_type.lower(), dtype)
        nodes.append(ir.node(op_type, list(inputs), attributes=attributes or None, outputs=[out]))
        return out

    acc = value("acc", ir.DataType.DOUBLE)
    k = value("k", ir.DataType.DOUBLE, [])
    zero = node("Constant", value=ir.tensor(np.array(0.0)))
    ten = node("Constant", value=ir.tensor(np.array(10.0)))
    term = node("Pow", node("Add", q, k), neg_x)
    in_range = node("Less", node("Sub", k, ten), extra, dtype=ir.DataType.BOOL)
    acc_out = node("Add", acc, node("Where", in_range, term, zero))
    body = ir.Graph([acc, k], [acc_out], nodes=nodes, name="zeta_power_terms")
    # at least one (masked) step: ORT's Scan fails on an empty sequence, and a 1 in the
    # reduction also keeps an empty tensor from reducing to -inf
    steps = op.ReduceMax(op.Concat(op.Reshape(extra, op.Constant(value_ints=[-1])), _d1(1.0), axis=0),
                         keepdims=0)
    ks = op.Range(_d(10.0), op.Add(_d(10.0), steps), _d(1.0))
    return op.Scan(total, ks, body=body, num_scan_inputs=1)


def _d1(value: float):
    return op.Constant(value=ir.tensor(np.array([value], dtype=np.float64)))


def _zeta64(x, q):
    """Cephes' Hurwitz zeta(x, q) in float64 (as eager runs it for every dtype).

    Direct sum of (q + k)^-x until q + k > 9, then Euler-Maclaurin with 12 Bernoulli terms.
    Eager stops each sum once a term is below MACHEP of the total; here every term is
    computed and the ones after that point are masked, which changes nothing that float64
    can represent and keeps overflowing terms (huge x) out of the result.
    """
    neg_x = op.Neg(x)
    q_nonpositive = op.LessOrEqual(q, _d(0.0))
    valid_negative_q = op.And(op.And(q_nonpositive, op.Not(_is_integer(q))),
                              op.And(_is_integer(x), op.Greater(x, _d(1.0))))
    extra = op.Where(valid_negative_q, op.Add(op.Floor(op.Neg(q)), _d(1.0)), _d(0.0))
    total = op.Pow(q, neg_x)
    done = op.Constant(value=ir.tensor(np.array(False)))
    for k in range(1, 10):
        term = op.Pow(op.Add(q, _d(float(k))), neg_x)
        total = op.Where(done, total, op.Add(total, term))
        # eager's test, signs included: never true while the sum is negative
        bound = op.Mul(_d(_MACHEP), total)
        done = op.Or(done, op.And(op.Less(op.Neg(bound), term), op.Less(term, bound)))
    # q <= 0: the terms past k = 9 (q + k still <= 9), which pass the pole region, so an early
    # "done" does not hold there; a sum already infinite is eager's answer (its corrections
    # would be inf * 0).
    total = _extra_power_terms(q, neg_x, extra, total)
    w = op.Add(op.Add(q, _d(9.0)), extra)
    b = op.Pow(w, neg_x)
    done = op.Or(op.And(done, op.Not(valid_negative_q)), op.IsInf(total))
    total_em = op.Sub(op.Add(total, op.Div(op.Mul(b, w), op.Sub(x, _d(1.0)))), op.Mul(_d(0.5), b))
    total = op.Where(done, total, total_em)
    a = _d(1.0)
    for i, coeff in enumerate(_ZETA_A):
        a = op.Mul(a, op.Add(x, _d(2.0 * i)))
        b = op.Div(b, w)
        t = op.Div(op.Mul(a, b), _d(coeff))
        new_total = op.Add(total, t)
        total = op.Where(done, total, new_total)
        done = op.Or(done, op.Less(op.Abs(op.Div(t, new_total)), _d(_MACHEP)))
        a = op.Mul(a, op.Add(x, _d(2.0 * i + 1.0)))
        b = op.Div(b, w)
    # domain, in eager's order of checks
    q_pole = op.And(q_nonpositive, _is_integer(q))
    nan_q = op.And(op.And(q_nonpositive, op.Not(_is_integer(q))), op.Not(_is_integer(x)))
    result = op.Where(nan_q, _nan(total), total)
    result = op.Where(q_pole, _inf(total), result)
    result = op.Where(op.Less(x, _d(1.0)), _nan(total), result)
    return op.Where(op.Equal(x, _d(1.0)), _inf(total), result)


def aten_special_zeta(self: TFloat, other: TFloat) -> TFloat:
    """special_zeta(Tensor self, Tensor other) -> Tensor: Hurwitz zeta(self, other)."""
    result = _zeta64(op.Cast(self, to=_DOUBLE), op.Cast(other, to=_DOUBLE))
    return op.CastLike(result, self)


# ---- error-function relatives ----------------------------------------------------------------


def aten_erfinv(self: TFloat) -> TFloat:
    """erfinv(Tensor self): eager's float algorithm in float32 (ORT has no float64 Erf).

    A rational first guess, then two Newton steps on erf(x) = y.
    """
    y = op.Cast(self, to=_FLOAT)
    y_abs = op.Abs(y)
    z = op.Mul(y, y)
    central = op.Div(op.Mul(y, _horner(z, (-0.140543331, 0.914624893, -1.645349621, 0.886226899), _f)),
                     _horner(z, (0.012229801, -0.329097515, 1.442710462, -2.118377725, 1.0), _f))
    t = op.Sqrt(op.Neg(op.Log(op.Div(op.Sub(_f(1.0), y_abs), _f(2.0)))))
    num = _horner(t, (1.641345311, 3.429567803, -1.624906493, -1.970840454), _f)
    # copysign(num, y): y = -0.0 only reaches the central branch
    tail = op.Div(op.Where(op.Less(y, _f(0.0)), op.Neg(op.Abs(num)), op.Abs(num)),
                  _horner(t, (1.637067800, 3.543889200, 1.0), _f))
    x = op.Where(op.LessOrEqual(y_abs, _f(0.7)), central, tail)
    for _ in range(2):
        slope = op.Mul(_f(2.0 / math.sqrt(_PI)), op.Exp(op.Neg(op.Mul(x, x))))
        x = op.Sub(x, op.Div(op.Sub(op.Erf(x), y), slope))
    x = op.Where(op.Equal(y_abs, _f(1.0)), op.Mul(_f(math.inf), op.Sign(y)), x)
    x = op.Where(op.Greater(y_abs, _f(1.0)), _f(math.nan), x)
    return op.CastLike(x, self)


_NDTRI_P0 = (-5.99633501014107895267E1, 9.80010754185999661536E1, -5.66762857469070293439E1,
             1.39312609387279679503E1, -1.23916583867381258016E0)
_NDTRI_Q0 = (1.0, 1.95448858338141759834E0, 4.67627912898881538453E0, 8.63602421390890590575E1,
             -2.25462687854119370527E2, 2.00260212380060660359E2, -8.20372256168333339912E1,
             1.59056225126211695515E1, -1.18331621121330003142E0)
_NDTRI_P1 = (4.05544892305962419923E0, 3.15251094599893866154E1, 5.71628192246421288162E1,
             4.40805073893200834700E1, 1.46849561928858024014E1, 2.18663306850790267539E0,
             -1.40256079171354495875E-1, -3.50424626827848203418E-2, -8.57456785154685413611E-4)
_NDTRI_Q1 = (1.0, 1.57799883256466749731E1, 4.53907635128879210584E1, 4.13172038254672030440E1,
             1.50425385692907503408E1, 2.50464946208309415979E0, -1.42182922854787788574E-1,
             -3.80806407691578277194E-2, -9.33259480895457427372E-4)
_NDTRI_P2 = (3.23774891776946035970E0, 6.91522889068984211695E0, 3.93881025292474443415E0,
             1.33303460815807542389E0, 2.01485389549179081538E-1, 1.23716634817820021358E-2,
             3.01581553508235416007E-4, 2.65806974686737550832E-6, 6.23974539184983293730E-9)
_NDTRI_Q2 = (1.0, 6.02427039364742014255E0, 3.67983563856160859403E0, 1.37702099489081330271E0,
             2.16236993594496635890E-1, 1.34204006088543189037E-2, 3.28014464682127739104E-4,
             2.89247864745380683936E-6, 6.79019408009981274425E-9)


def aten_special_ndtri(self: TFloat) -> TFloat:
    """special_ndtri(Tensor self): Cephes ndtri (as eager), in float64."""
    y0 = op.Cast(self, to=_DOUBLE)
    exp_m2 = 0.13533528323661269189
    upper = op.Greater(y0, _d(1.0 - exp_m2))
    y = op.Where(upper, op.Sub(_d(1.0), y0), y0)
    # central: |y - 0.5| <= 3/8
    yc = op.Sub(y, _d(0.5))
    y2 = op.Mul(yc, yc)
    central = op.Mul(op.Add(yc, op.Mul(yc, op.Div(op.Mul(y2, _horner(y2, _NDTRI_P0)),
                                                 _horner(y2, _NDTRI_Q0)))),
                     _d(2.50662827463100050242))
    # tails: z = sqrt(-2 log y); the log keeps y = 0 (the -inf result) out of nan territory
    tiny = op.Where(op.Greater(y, _d(0.0)), y, _d(0.5))
    x = op.Sqrt(op.Mul(_d(-2.0), op.Log(tiny)))
    x0 = op.Sub(x, op.Div(op.Log(x), x))
    z = op.Reciprocal(x)
    x1 = op.Where(op.Less(x, _d(8.0)),
                  op.Div(op.Mul(z, _horner(z, _NDTRI_P1)), _horner(z, _NDTRI_Q1)),
                  op.Div(op.Mul(z, _horner(z, _NDTRI_P2)), _horner(z, _NDTRI_Q2)))
    tail = op.Sub(x0, x1)
    tail = op.Where(upper, tail, op.Neg(tail))
    result = op.Where(op.Greater(y, _d(exp_m2)), central, tail)
    result = op.Where(op.Equal(y0, _d(0.0)), _d(-math.inf), result)
    result = op.Where(op.Equal(y0, _d(1.0)), _d(math.inf), result)
    outside = op.Or(op.Or(op.Less(y0, _d(0.0)), op.Greater(y0, _d(1.0))), op.IsNaN(y0))
    result = op.Where(outside, _d(math.nan), result)
    return op.CastLike(result, self)


def _erfcx_nonnegative(x):
    """erfcx for x >= 0 in float64: exp(x^2) - 2/sqrt(pi) sum (2x^2)^n x / (2n+1)!! below 2
    (positive terms: erf without cancellation), Laplace's continued fraction from 2 on."""
    small = op.Min(x, _d(2.0))
    term, total = small, small
    two_x2 = op.Mul(_d(2.0), op.Mul(small, small))
    for n in range(1, 40):
        term = op.Div(op.Mul(term, two_x2), _d(2.0 * n + 1.0))
        total = op.Add(total, term)
    series = op.Sub(op.Exp(op.Mul(small, small)), op.Mul(_d(2.0 / math.sqrt(_PI)), total))
    large = op.Max(x, _d(2.0))
    fraction = _d(0.0)
    for n in range(40, 0, -1):
        fraction = op.Div(_d(n / 2.0), op.Add(large, fraction))
    continued = op.Div(_d(1.0 / math.sqrt(_PI)), op.Add(large, fraction))
    return op.Where(op.Less(x, _d(2.0)), series, continued)


def aten_erfc(self: TFloat) -> TFloat:
    """erfc(Tensor self): exp(-x^2) erfcx(x) from x = 0.5 on, in float64. torchlib's
    1 - erf(x) cancels: erfc(3) was 0.1% off and erfc(5) (1.5e-12) came out 0."""
    x = op.Cast(self, to=_DOUBLE)
    tail = op.Mul(op.Exp(op.Neg(op.Mul(x, x))), _erfcx_nonnegative(op.Max(x, _d(0.5))))
    head = op.Cast(op.Sub(_f(1.0), op.Erf(op.Cast(self, to=1))), to=_DOUBLE)  # ORT has no float64 Erf
    return op.CastLike(op.Where(op.Less(x, _d(0.5)), head, tail), self)


def aten_special_erfcx(self: TFloat) -> TFloat:
    """special_erfcx(Tensor self) = exp(x^2) erfc(x); erfcx(-x) = 2 exp(x^2) - erfcx(x)."""
    x = op.Cast(self, to=_DOUBLE)
    positive = _erfcx_nonnegative(op.Abs(x))
    negative = op.Sub(op.Mul(_d(2.0), op.Exp(op.Mul(x, x))), positive)
    return op.CastLike(op.Where(op.Less(x, _d(0.0)), negative, positive), self)


# ---- floating-point decomposition ------------------------------------------------------------


def aten_frexp(self: TFloat) -> tuple[TFloat, INT32]:
    """frexp.Tensor(Tensor self) -> (mantissa, exponent): x = m 2^e, 0.5 <= |m| < 1.

    e from log2 |x| in float64, then corrected by one either way (log rounding); scaling by a
    power of two is exact. 0, inf and nan give (x, 0), as eager.
    """
    x = op.Cast(self, to=_DOUBLE)
    finite_nonzero = op.And(op.Not(op.Equal(x, _d(0.0))), op.Not(op.Or(op.IsInf(x), op.IsNaN(x))))
    safe = op.Where(finite_nonzero, op.Abs(x), _d(1.0))
    e = op.Add(op.Floor(op.Div(op.Log(safe), _d(math.log(2.0)))), _d(1.0))
    half = op.Floor(op.Mul(e, _d(0.5)))  # two steps: 2^1024 (x near float64 max) overflows
    m = op.Div(op.Div(safe, op.Pow(_d(2.0), half)), op.Pow(_d(2.0), op.Sub(e, half)))
    too_big = op.GreaterOrEqual(m, _d(1.0))
    e = op.Where(too_big, op.Add(e, _d(1.0)), e)
    m = op.Where(too_big, op.Mul(m, _d(0.5)), m)
    too_small = op.Less(m, _d(0.5))
    e = op.Where(too_small, op.Sub(e, _d(1.0)), e)
    m = op.Where(too_small, op.Mul(m, _d(2.0)), m)
    m = op.Where(op.Less(x, _d(0.0)), op.Neg(m), m)
    mantissa = op.CastLike(op.Where(finite_nonzero, m, x), self)
    exponent = op.Cast(op.Where(finite_nonzero, e, _d(0.0)), to=6)  # int32
    return mantissa, exponent


LOWERINGS: dict = {
    aten.lgamma.default: aten_lgamma,
    aten.digamma.default: aten_digamma,
    aten.polygamma.default: aten_polygamma,
    aten.special_zeta.default: aten_special_zeta,
    aten.erfinv.default: aten_erfinv,
    aten.special_ndtri.default: aten_special_ndtri,
    aten.special_erfcx.default: aten_special_erfcx,
    aten.erfc.default: aten_erfc,
    aten.frexp.Tensor: aten_frexp,
}

_LOW_PRECISION = (torch.float32, torch.float16, torch.bfloat16)
# frexp is exact (power-of-two scaling) in every dtype, float64 included
ACCURATE_DTYPES = {target: _LOW_PRECISION for target in LOWERINGS if target is not aten.frexp.Tensor}
