"""Special functions (ort_dynamo/lowerings/special.py) on ORT: values and gradients vs eager.

Inputs span each function's domain: negative arguments, points next to poles, zeros of the
function, huge and tiny magnitudes, and inf/nan, where eager has defined answers.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

import ort_dynamo

_INF, _NAN = float("inf"), float("nan")


def _real_line():
    special = [0.0, -0.0, 1.0, 2.0, -1.0, -2.0, -2.5, -0.5, 0.5, 1.4616321, 10.0, 9.999, 1e-30, -1e-30,
               1e-7, -3.0001, -2.9999, 1e10, 1e30, -1e10, _INF, -_INF, _NAN]
    return torch.cat([torch.linspace(-20, 20, 801), torch.logspace(-6, 6, 200),
                      0.25 - torch.logspace(-6, 3, 200), torch.tensor(special)])


def _check(fn, x, *, rtol=1e-4, atol=1e-5, grad=True):
    """fn on ORT equals eager (values and d sum(fn)/dx), with nothing left in PyTorch."""
    compiled = torch.compile(fn, backend="ort", dynamic=False)
    ort_dynamo.reset()
    torch.testing.assert_close(compiled(x), fn(x), rtol=rtol, atol=atol, equal_nan=True)
    assert ort_dynamo.report().fallback_nodes == 0, ort_dynamo.report().fallbacks
    if grad:
        xe, xa = x.clone().requires_grad_(), x.clone().requires_grad_()
        expected, = torch.autograd.grad(fn(xe).sum(), xe)
        ort_dynamo.reset()
        actual, = torch.autograd.grad(compiled(xa).sum(), xa)
        assert ort_dynamo.report().fallback_nodes == 0, ort_dynamo.report().fallbacks
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, equal_nan=True)


@pytest.mark.parametrize("name, fn", [
    ("lgamma", torch.lgamma),  # backward: digamma
    ("digamma", torch.digamma),  # backward: trigamma
    ("trigamma", lambda t: torch.polygamma(1, t)),  # backward: polygamma(2) -> Hurwitz zeta
    ("polygamma3", lambda t: torch.polygamma(3, t)),
])
def test_gamma_family(name, fn):
    _check(fn, _real_line())


def test_gamma_family_half_precision():
    x = torch.linspace(-6.3, 9, 200)
    for dtype in (torch.float16, torch.bfloat16):
        _check(torch.lgamma, x.to(dtype), rtol=1e-2, atol=1e-2, grad=False)
        _check(torch.digamma, x.to(dtype), rtol=1e-2, atol=1e-2, grad=False)


def test_zeta():
    q = _real_line()
    # integer s with negative q sums up to ~1000 terms before Euler-Maclaurin (an ONNX Scan)
    _check(lambda t: torch.special.zeta(torch.tensor(3.0), t), q, grad=False)
    _check(lambda t: torch.special.zeta(torch.tensor(5.5), t), q, grad=False)
    s = torch.cat([torch.linspace(-2, 60, 500), torch.tensor([1.0, 1.0001, 1e4, _INF, _NAN])])
    _check(lambda t: torch.special.zeta(t, torch.tensor(0.7)), s, grad=False)
    _check(lambda t: torch.special.zeta(t, torch.tensor(-2.5)), s, grad=False)


def test_error_function_relatives():
    x = _real_line()
    _check(torch.special.erfcx, x)  # torchlib's was off by up to 0.13 for x < 0
    _check(torch.special.log_ndtr, x)  # decomposed by torch into erfcx & co.
    y = torch.cat([torch.linspace(-1.01, 1.01, 2021), torch.tensor([1.0, -1.0, 0.99999, -0.99999, 1e-30])])
    _check(torch.erfinv, y)
    p = torch.cat([torch.linspace(-0.01, 1.01, 1021), torch.logspace(-38, -1, 200), 1 - torch.logspace(-7, -1, 50)])
    _check(torch.special.ndtri, p)


def test_frexp_exact_in_every_dtype():
    base = torch.tensor([0.0, -0.0, 1.0, 0.75, -3.0, 0.5, 2.0 ** -126, 2.0 ** -127, 1e-45, 3.4e38, _INF, -_INF, _NAN])
    for dtype in (torch.float32, torch.float16, torch.float64):
        x = torch.cat([torch.randn(300, dtype=torch.float64) * torch.logspace(-40, 38, 300, dtype=torch.float64),
                       base.double()]).to(dtype)
        if dtype == torch.float64:
            x = torch.cat([x, torch.tensor([5e-324, 1e-310, 1.7e308], dtype=dtype)])
        ort_dynamo.reset()
        mantissa, exponent = torch.compile(torch.frexp, backend="ort", dynamic=False)(x)
        assert ort_dynamo.report().fallback_nodes == 0
        expected_mantissa, expected_exponent = torch.frexp(x)
        assert torch.equal(exponent, expected_exponent)
        torch.testing.assert_close(mantissa, expected_mantissa, rtol=0, atol=0, equal_nan=True)


def test_float64_stays_in_pytorch():
    """The approximations are float32-grade: float64 runs eagerly, with the reason reported."""
    x = torch.linspace(0.5, 5, 10, dtype=torch.float64)
    ort_dynamo.reset()
    out = torch.compile(torch.lgamma, backend="ort", dynamic=False)(x)
    torch.testing.assert_close(out, torch.lgamma(x), rtol=1e-12, atol=0)
    reasons = [fb.reason for fb in ort_dynamo.report().fallbacks if "lgamma" in fb.op]
    assert reasons and "float64 runs in PyTorch" in reasons[0], ort_dynamo.report().fallbacks


# ---- the OpInfo sweep's own samples --------------------------------------------------------------

_SWEEP_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "opinfo_sweep.py")


@pytest.mark.parametrize("name", ["polygamma.polygamma_n_2", "mvlgamma.mvlgamma_p_3", "special.zeta",
                                  "special.erfcx"])
def test_opinfo_samples(name):
    pytest.importorskip("expecttest", reason="torch's OpInfo database imports expecttest")
    spec = importlib.util.spec_from_file_location("opinfo_sweep", _SWEEP_PATH)
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    op = next(op for op in _op_db() if sweep.op_key(op) == name)
    result = sweep.run_one_op(op, samples=3)
    assert result["status"] == "pass", result["detail"]
    assert result["fallback_nodes"] == 0 and result["ort_nodes"] > 0, result["fallbacks"]


def _op_db():
    from torch.testing._internal.common_methods_invocations import op_db
    return op_db
