"""Bessel/Airy functions and orthogonal polynomials run on ORT and match eager PyTorch
(ort_dynamo/lowerings/bessel.py replays aten's Math.h algorithms)."""

import pytest
import torch

import ort_dynamo

# Fails instead of quietly running a partition in PyTorch when ORT rejects the graph.
_OPTIONS = {"fallback_policy": "UNSUPPORTED_OP"}

# Both sides of every branch point (0, 2, 2.09, 5, 8), tiny, large and non-finite values.
_X = torch.tensor([0.0, 1e-6, -1e-6, 1e-3, 0.3, -0.3, 0.5, 1.0, -1.0, 2.0, -2.0, 2.09, -2.09, 3.0,
                   -4.5, 4.99, 5.0, 5.01, -6.5, 7.99, 8.0, 8.01, -9.0, 12.5, 20.0, -20.0, 35.0,
                   60.0, 100.0, 105.0, 1e4, float("inf"), float("-inf"), float("nan")])

_UNARY = {
    "i0": torch.i0, "i0e": torch.special.i0e, "i1": torch.special.i1, "i1e": torch.special.i1e,
    "bessel_j0": torch.special.bessel_j0, "bessel_j1": torch.special.bessel_j1,
    "bessel_y0": torch.special.bessel_y0, "bessel_y1": torch.special.bessel_y1,
    "modified_bessel_i0": torch.special.modified_bessel_i0,
    "modified_bessel_i1": torch.special.modified_bessel_i1,
    "modified_bessel_k0": torch.special.modified_bessel_k0,
    "modified_bessel_k1": torch.special.modified_bessel_k1,
    "scaled_modified_bessel_k0": torch.special.scaled_modified_bessel_k0,
    "scaled_modified_bessel_k1": torch.special.scaled_modified_bessel_k1,
    "spherical_bessel_j0": torch.special.spherical_bessel_j0,
    "airy_ai": torch.special.airy_ai,
}


def _compiled(fn):
    ort_dynamo.reset()
    return torch.compile(fn, backend="ort", dynamic=False, options=_OPTIONS)


def _all_in_ort():
    report = ort_dynamo.report()
    assert report.fallback_nodes == 0, report.fallbacks


def _unary_model(fns):
    return lambda x: torch.stack([fn(x) for fn in fns])


def test_bessel_functions_float32_and_float64():
    fns = list(_UNARY.values())
    for dtype, rtol, atol in ((torch.float32, 1e-5, 1e-6), (torch.float64, 1e-11, 1e-14)):
        x = _X.to(dtype)
        got = _compiled(_unary_model(fns))(x)
        _all_in_ort()
        torch.testing.assert_close(got, _unary_model(fns)(x), rtol=rtol, atol=atol, equal_nan=True)


def test_modified_bessel_gradients():
    # i0' = i1, i0e' = i1e - sgn(x) i0e, i1' and i1e' use i0/i0e: all four run on ORT.
    fns = [torch.i0, torch.special.i0e, torch.special.i1, torch.special.i1e]
    x0 = torch.tensor([0.0, 1e-6, -0.4, 1.5, -3.0, 7.9, 8.1, -15.0, 40.0])
    model = _unary_model(fns)
    x = x0.clone().requires_grad_()
    got = _compiled(model)(x)
    (grad,) = torch.autograd.grad(got.sum(), x)
    _all_in_ort()
    x = x0.clone().requires_grad_()
    expected = model(x)
    (expected_grad,) = torch.autograd.grad(expected.sum(), x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_modified_bessel_half_precision(dtype):
    # Computed in float32 and rounded, as eager's vectorized kernel does: at most 1 ulp apart.
    fns = [torch.i0, torch.special.i0e, torch.special.i1, torch.special.i1e]
    x = torch.linspace(-9, 9, 37).to(dtype)
    got = _compiled(_unary_model(fns))(x)
    _all_in_ort()
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(got, _unary_model(fns)(x), rtol=eps, atol=1e-3)


def test_integer_input_gives_float32():
    x = torch.arange(-3, 12)
    fns = [torch.special.bessel_j0, torch.special.modified_bessel_k1, torch.special.i1e]
    got = _compiled(_unary_model(fns))(x)
    _all_in_ort()
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, _unary_model(fns)(x), rtol=1e-5, atol=1e-6, equal_nan=True)


_POLYNOMIALS = [f"{kind}chebyshev_polynomial_{letter}" for kind in ("", "shifted_")
                for letter in "tuvw"] + ["hermite_polynomial_h", "hermite_polynomial_he",
                                         "laguerre_polynomial_l", "legendre_polynomial_p"]

# |x| = 1 and x = 0 (the shifted ends), |x| < 1 (the trigonometric forms above degree 4..8), |x| > 1
# (the recurrence); degrees negative, small, fractional (truncated), large, non-finite.
_PX = torch.tensor([0.0, 1.0, -1.0, 0.5, -0.5, 0.25, 0.75, 0.99, -0.3, 1.5, -1.5, 3.0, -8.0, 1e-3,
                    float("inf")])[:, None]
_PN = torch.tensor([-2.0, -1.0, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 12.0, 30.0, 3.7,
                    float("nan")])[None, :]


def _polynomial_model(names, n=None):
    fns = [getattr(torch.special, name) for name in names]
    if n is None:
        return lambda x, n: torch.stack([fn(x, n) for fn in fns])
    return lambda x: torch.stack([fn(x, n) for fn in fns])


def test_polynomials_with_tensor_degree():
    # n is data: the recurrence is an ONNX Loop that runs as long as the longest element's.
    model = _polynomial_model(_POLYNOMIALS)
    got = _compiled(model)(_PX, _PN)
    _all_in_ort()
    torch.testing.assert_close(got, model(_PX, _PN), rtol=1e-4, atol=1e-5, equal_nan=True)


def test_polynomials_with_python_degree_and_float64():
    # Python-number degrees (the n_scalar overloads) on all; float64 on the families that
    # avoid acos (Hermite, Laguerre, Legendre).
    x = torch.linspace(-2.5, 2.5, 41)
    for n in (5, 13):
        model = _polynomial_model(_POLYNOMIALS, n)
        got = _compiled(model)(x)
        _all_in_ort()
        torch.testing.assert_close(got, model(x), rtol=1e-4, atol=1e-4)
    names = _POLYNOMIALS[8:]
    model = _polynomial_model(names)
    x64, n64 = _PX.double()[:-1], _PN.double()
    got = _compiled(model)(x64, n64)
    _all_in_ort()
    torch.testing.assert_close(got, model(x64, n64), rtol=1e-11, atol=1e-12, equal_nan=True)


def test_chebyshev_float64_stays_in_pytorch():
    x, n = _PX.double(), _PN.double()
    fn = torch.special.chebyshev_polynomial_t
    got = _compiled(fn)(x, n)
    fallbacks = ort_dynamo.report().fallbacks
    assert [f.op for f in fallbacks] == ["aten.special_chebyshev_polynomial_t.default"]
    assert "accurate for float32 only" in fallbacks[0].reason
    torch.testing.assert_close(got, fn(x, n), equal_nan=True)
