"""Linear algebra on ORT (ort_dynamo/lowerings/linalg.py): inverse, determinants, solves and
factorizations, unrolled into ONNX ops, must match eager forward and backward."""

from __future__ import annotations

import warnings

import pytest
import torch

import ort_dynamo
from parity import torch_older_than

warnings.filterwarnings("ignore", message=".*triangular_solve is deprecated.*")


def _run(fn, *inputs, grad=True):
    """(eager outputs, compiled outputs, eager input grads, compiled input grads)."""
    def prepare():
        return [x.detach().clone().requires_grad_(grad and x.is_floating_point()) for x in inputs]

    eager_in, ort_in = prepare(), prepare()
    eager = fn(*eager_in)
    compiled = torch.compile(fn, backend="ort", dynamic=False)(*ort_in)
    eager = eager if isinstance(eager, tuple) else (eager,)
    compiled = compiled if isinstance(compiled, tuple) else (compiled,)
    if not grad:
        return eager, compiled, [], []
    generator = torch.Generator().manual_seed(1)
    weights = [torch.randn(e.shape, generator=generator, dtype=e.dtype) if e.is_floating_point() else None
               for e in eager]
    for outs, ins in ((eager, eager_in), (compiled, ort_in)):
        sum((o * w).sum() for o, w in zip(outs, weights) if w is not None).backward()
    return eager, compiled, [x.grad for x in eager_in], [x.grad for x in ort_in]


def _assert_close(eager, compiled, rtol=1e-4, atol=1e-5):
    assert len(eager) == len(compiled)
    for e, c in zip(eager, compiled):
        if e is None:
            assert c is None
            continue
        assert c.dtype == e.dtype and c.shape == e.shape
        torch.testing.assert_close(c, e, rtol=rtol, atol=atol, equal_nan=True)


def _check(fn, *inputs, grad=True, fallbacks=0):
    eager, compiled, eager_grads, ort_grads = _run(fn, *inputs, grad=grad)
    _assert_close(eager, compiled)
    _assert_close(eager_grads, ort_grads, atol=1e-4)
    assert ort_dynamo.report().fallback_nodes == fallbacks, ort_dynamo.report().fallbacks


def _well_conditioned(*shape):
    return torch.randn(*shape) + 3 * torch.eye(shape[-1])


def test_inverse_and_determinants_batched():
    def fn(a):
        sign, logabsdet = torch.linalg.slogdet(a)
        return torch.linalg.inv_ex(a).inverse, torch.linalg.det(a), sign, logabsdet

    _check(fn, _well_conditioned(2, 3, 5, 5))


def test_determinant_unbatched_and_of_a_transposed_view():
    # det's LU is of A^T for a contiguous A and of A otherwise; its backward depends on which.
    a = torch.randn(4, 4)
    _check(lambda x: torch.linalg.det(x) + torch.logdet(x @ x.mT + torch.eye(4)), a)
    ort_dynamo.reset()
    _check(lambda x: torch.linalg.det((2 * x).mT), a)


def test_solve_broadcast_vector_and_right_hand():
    a = _well_conditioned(2, 4, 4)

    def fn(a, b, v, r):
        return (torch.linalg.solve_ex(a, b).result,  # (2,4,4) with (4,3): batch broadcast
                torch.linalg.solve_ex(a[0], v).result,  # vector right-hand side
                torch.linalg.solve_ex(a, r, left=False).result)  # X A = B

    _check(fn, a, torch.randn(4, 3), torch.randn(4), torch.randn(2, 3, 4))


def test_triangular_and_cholesky_solves():
    upper = torch.randn(2, 4, 4).triu() + 3 * torch.eye(4)
    spd = _well_conditioned(3, 3)
    factor = torch.linalg.cholesky(spd @ spd.mT)

    def fn(u, b, l, c):
        return (torch.linalg.solve_triangular(u, b, upper=True),
                torch.linalg.solve_triangular(u.mT, b.mT, upper=False, left=False, unitriangular=True),
                torch.triangular_solve(b, u, upper=True, transpose=True).solution,
                torch.cholesky_solve(c, l), torch.cholesky_solve(c, l.mT, upper=True),
                torch.cholesky_inverse(l))

    _check(fn, upper, torch.randn(4, 2), factor, torch.randn(3, 2))


def test_float64_ill_conditioned_solve_is_as_accurate_as_eager():
    n = 8
    i = torch.arange(n, dtype=torch.float64)
    hilbert = 1 / (i[:, None] + i[None, :] + 1)  # condition number ~1e10
    b = torch.randn(n, 2, dtype=torch.float64)
    compiled = torch.compile(lambda a, b: torch.linalg.solve_ex(a, b).result, backend="ort")(hilbert, b)
    eager = torch.linalg.solve(hilbert, b)
    def residual(x):
        return ((hilbert @ x - b).norm() / (hilbert.norm() * x.norm())).item()

    assert residual(compiled) < 1e-15 and residual(compiled) < 10 * residual(eager) + 1e-16
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=0)
    assert ort_dynamo.report().fallback_nodes == 0


def test_singular_matrices_match_eager():
    singular = torch.tensor([[[1.0, 2.0], [2.0, 4.0]], [[2.0, 0.0], [0.0, 3.0]]])

    def fn(a, b):
        inverse, info = torch.linalg.inv_ex(a)
        solution, solve_info = torch.linalg.solve_ex(a, b)
        sign, logabsdet = torch.linalg.slogdet(a)
        return inverse, info, solution, solve_info, torch.linalg.det(a), sign, logabsdet

    eager, compiled, _, _ = _run(fn, singular, torch.ones(2, 1), grad=False)
    _assert_close(eager, compiled)
    assert compiled[1].tolist() == [2, 0]  # LAPACK's info: the first zero pivot, 1-based
    assert torch.isinf(compiled[0][0]).all() and compiled[4][0] == 0
    assert ort_dynamo.report().fallback_nodes == 0


@pytest.mark.skipif(torch_older_than(2, 13),
                    reason="torch 2.11 returns infinities for a compiled singular inverse, aot_eager too")
def test_singular_inverse_raises_like_eager():
    # linalg.inv checks the info computed on ORT in PyTorch (_linalg_check_errors).
    singular = torch.tensor([[1.0, 2.0], [2.0, 4.0]])
    with pytest.raises(torch.linalg.LinAlgError, match="singular") as eager_error:
        torch.linalg.inv(singular)
    with pytest.raises(torch.linalg.LinAlgError, match="singular") as ort_error:
        torch.compile(torch.linalg.inv, backend="ort")(singular)
    assert str(ort_error.value) == str(eager_error.value)


def test_inverse_and_solve_with_their_error_checks_run_on_ort():
    # The error check stays in PyTorch (it raises or does nothing); it is not a fallback.
    def fn(a, b):
        return torch.linalg.inv(a), torch.linalg.solve(a, b), torch.linalg.tensorinv(a.reshape(4, 2, 2), ind=1)

    a = _well_conditioned(4, 4)
    _check(fn, a, torch.randn(4, 2))


def test_lu_factor_pivots_and_info():
    a = torch.randn(3, 5, 5)
    _check(lambda x: torch.linalg.lu_factor_ex(x), a, grad=False)


def test_empty_matrices():
    _check(lambda a: (torch.linalg.inv_ex(a).inverse, torch.linalg.det(a)), torch.randn(2, 0, 0))


def test_matrices_above_the_unroll_limit_stay_in_pytorch():
    from ort_dynamo.lowerings.linalg import MAX_N

    a = _well_conditioned(MAX_N + 1, MAX_N + 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = torch.compile(torch.linalg.det, backend="ort", dynamic=False)(a)
    torch.testing.assert_close(compiled, torch.linalg.det(a), rtol=1e-4, atol=1e-5)
    reasons = [f.reason for f in ort_dynamo.report().fallbacks]
    assert any(r.startswith("export failed") and "unrolled limit" in r for r in reasons), reasons


def test_cholesky_lu_and_qr_factorizations():
    spd = _well_conditioned(2, 4, 4)

    def fn(s, a):
        return (*torch.linalg.cholesky_ex(s), torch.linalg.cholesky_ex(s, upper=True).L,
                *torch.linalg.lu(a), *torch.linalg.qr(a), torch.linalg.qr(a.mT, mode="complete").Q)

    _check(fn, spd @ spd.mT, torch.randn(2, 5, 3))


def test_cholesky_of_a_matrix_not_positive_definite_matches_eager():
    # LAPACK stops at the first non-positive pivot: info and the partial factor are eager's.
    a = torch.tensor([[4.0, 2, 1, 7], [2, -3, 1, 8], [1, 1, 5, 9], [3, 4, 5, 6]])
    eager, compiled, _, _ = _run(lambda x: (*torch.linalg.cholesky_ex(x),
                                            *torch.linalg.cholesky_ex(x, upper=True)), a, grad=False)
    _assert_close(eager, compiled)
    assert compiled[1].item() == 2
    assert ort_dynamo.report().fallback_nodes == 0


def test_lu_solve_through_its_factorization():
    # the backward of lu_factor + lu_solve needs lu_unpack and triangular solves
    def fn(a, b, c):
        LU, pivots, _ = torch.linalg.lu_factor_ex(a)
        return (torch.linalg.lu_solve(LU, pivots, b), torch.linalg.lu_solve(LU, pivots, c, adjoint=True, left=False),
                *torch.lu_unpack(LU, pivots))

    _check(fn, _well_conditioned(2, 4, 4), torch.randn(4, 3), torch.randn(2, 3, 4))


def test_householder_product():
    _check(torch.linalg.householder_product, torch.randn(2, 6, 4), torch.rand(2, 3))


def test_matrix_exp_every_degree_and_scaling():
    # 1-norms across all of eager's Taylor degrees (1 to 18) and with squarings
    scales = torch.tensor([1e-8, 1e-4, 0.01, 0.1, 0.3, 0.7, 2.0])[:, None, None]
    a = torch.randn(7, 3, 3) * scales
    _check(torch.linalg.matrix_exp, a)
    # the derivative is the exponential of a 2n x 2n block matrix
    eager, compiled, _, _ = _run(torch.linalg.matrix_exp, torch.randn(2, 4, 4, dtype=torch.float64), grad=False)
    _assert_close(eager, compiled, rtol=1e-10, atol=1e-12)
