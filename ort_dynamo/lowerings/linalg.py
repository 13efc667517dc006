"""Linear algebra (inverse, determinant, solves, factorizations) as ONNX graphs.

ONNX has no LU, triangular solve or Cholesky. With a static matrix size ``n`` they are
unrolled at export time into ``n`` steps of vectorized ops over the whole (batched) matrix:
LU with partial pivoting (LAPACK's getf2: first largest |pivot|, row swaps, ``info`` = index
of the first exactly-zero pivot, elimination continuing past it) and column-oriented
substitution. Same algorithms as LAPACK, so same accuracy; a singular matrix gives the
zero pivot, ``info`` and inf/nan eager gives, and ``_linalg_check_errors`` (kept in PyTorch)
raises eager's error from that ``info``. Pivots are LAPACK's: int32, 1-based, sequential swaps.

Matrices larger than ``MAX_N`` (or of dynamic size) raise at export time, so their
partition stays in PyTorch with the reason in ``ort_dynamo.report()``.
"""

from __future__ import annotations

import itertools

import numpy as np
import onnx
import onnx_ir as ir
import torch
from onnxscript.onnx_opset import opset18 as op
from onnxscript.values import Op

aten = torch.ops.aten

#: Largest unrolled matrix size: the graph grows as O(n) steps of O(1) nodes each.
MAX_N = 32

_INT32, _INT64 = 6, 7


def _const(array) -> ir.Value:
    return op.Constant(value=ir.tensor(np.asarray(array)))


def _ints(*values) -> ir.Value:
    return op.Constant(value_ints=list(values))


def _size(x, what: str = "matrix") -> int:
    """The static size of ``x``'s square trailing matrices (raises if dynamic or too large)."""
    shape = x.shape
    if shape is None or len(shape) < 1 or not isinstance(shape[-1], int):
        raise ValueError(f"{what} size must be static for ort_dynamo's unrolled linear algebra")
    n = shape[-1]
    if n > MAX_N:
        raise ValueError(f"{n}x{n} {what} is larger than ort_dynamo's unrolled limit {MAX_N}x{MAX_N}")
    return n


def _dims(x, what: str = "matrix") -> tuple[int, int]:
    """Static (rows, columns) of ``x``'s trailing matrices, each at most MAX_N."""
    shape = x.shape
    if shape is None or len(shape) < 2 or not isinstance(shape[-2], int):
        raise ValueError(f"{what} size must be static for ort_dynamo's unrolled linear algebra")
    return shape[-2], _size(x, what)


def _mT(x):
    """Swap the last two axes (Einsum: intermediate values' ranks are not known here)."""
    return op.Einsum(x, equation="...ij->...ji")


def _row(x, i):
    return op.Slice(x, _ints(i), _ints(i + 1), _ints(-2))


def _col(x, i):
    return op.Slice(x, _ints(i), _ints(i + 1), _ints(-1))


def _entry(x, i, j):
    return op.Slice(x, _ints(i, j), _ints(i + 1, j + 1), _ints(-2, -1))


def _batch_zeros_int(x):
    """int64 zeros of ``x``'s batch shape (everything but the last two axes)."""
    return op.Expand(op.Constant(value_int=0), op.Shape(x, start=0, end=-2))


def _batch_full(x, value: float):
    """``value`` in ``x``'s dtype, of ``x``'s batch shape."""
    return op.Expand(op.CastLike(_const(value), x), op.Shape(x, start=0, end=-2))


# ---- LU with partial pivoting -----------------------------------------------------------------

def _lu(A, n, m=None):
    """LU of (..., m, n) matrices (m defaults to n): (LU, pivots int64 0-based (..., min(m, n)),
    info int64 (...), number of row swaps (...))."""
    m = n if m is None else m
    rows = np.arange(m).reshape(m, 1)
    cols = np.arange(n).reshape(1, n)
    row_index = _const(rows.astype(np.int64))
    info = _batch_zeros_int(A)
    swaps = info
    pivots = []
    zero, one = op.CastLike(_const(0.0), A), op.CastLike(_const(1.0), A)
    for k in range(min(m, n)):
        if k < m - 1:
            candidates = op.Where(_const(rows >= k), op.Abs(_col(A, k)), op.Neg(one))
            p = op.ArgMax(candidates, axis=-2, keepdims=1)  # (..., 1, 1): first largest, as idamax
            order = op.Where(op.Equal(row_index, _const(np.int64(k))), p,
                             op.Where(op.Equal(row_index, p), _const(np.int64(k)), row_index))
            A = op.GatherElements(A, op.Expand(order, op.Shape(A)), axis=-2)
            p = op.Squeeze(p, _ints(-1))  # (..., 1)
            swaps = op.Add(swaps, op.Cast(op.Squeeze(op.Not(op.Equal(p, _const(np.int64(k)))), _ints(-1)),
                                          to=_INT64))
        else:
            p = op.Expand(_const(np.array([k], dtype=np.int64)), op.Shape(A, start=0, end=-1))
            p = op.Slice(p, _ints(0), _ints(1), _ints(-1))
        pivots.append(p)
        pivot = _entry(A, k, k)
        singular = op.Equal(pivot, zero)
        first = op.And(op.Equal(info, _const(np.int64(0))), op.Squeeze(singular, _ints(-2, -1)))
        info = op.Where(first, _const(np.int64(k + 1)), info)
        if k < m - 1:
            # getf2 skips the scaling at a zero pivot: the column below is zero then.
            multipliers = op.Div(_col(A, k), op.Where(singular, one, pivot))
            below = op.Where(_const((rows > k) & (cols == k)), multipliers, A)
            if k < n - 1:
                updated = op.Sub(A, op.Mul(multipliers, _row(A, k)))
                below = op.Where(_const((rows > k) & (cols > k)), updated, below)
            A = below
    if not pivots:  # empty matrices
        pivots = [op.ConstantOfShape(op.Concat(op.Shape(A, start=0, end=-2), _ints(0), axis=0),
                                     value=ir.tensor(np.array([0], dtype=np.int64)))]
    return A, op.Concat(*pivots, axis=-1), info, swaps


def _permutation(pivots, m, k):
    """0-based LAPACK pivots (sequential row swaps, int64 (..., k)) of m-row matrices ->
    ``perm`` (..., m) with ``(P^T B)[j] = B[perm[j]]`` where ``A = P L U``."""
    index = _const(np.arange(m, dtype=np.int64))
    perm = op.Expand(index, op.Concat(op.Shape(pivots, start=0, end=-1), _ints(m), axis=0))
    for i in range(min(k, m - 1)):
        p = op.Slice(pivots, _ints(i), _ints(i + 1), _ints(-1))
        here = op.Slice(perm, _ints(i), _ints(i + 1), _ints(-1))
        there = op.GatherElements(perm, p, axis=-1)
        perm = op.Where(op.Equal(index, _const(np.int64(i))), there,
                        op.Where(op.Equal(index, p), here, perm))
    return perm


def _permutation_matrix(pivots, like, m, k=None):
    """``P^T`` as a 0/1 matrix (..., m, m) of ``like``'s dtype; ``k`` pivots (default m)."""
    perm = op.Unsqueeze(_permutation(pivots, m, m if k is None else k), _ints(-1))
    return op.CastLike(op.Equal(perm, _const(np.arange(m, dtype=np.int64).reshape(1, m))), like)


# ---- triangular solves --------------------------------------------------------------------------

def _trsm(T, B, n, lower: bool, unit: bool):
    """Solve ``T X = B`` for X, reading only ``T``'s ``lower``/upper triangle (and diagonal
    unless ``unit``). Batch axes broadcast."""
    rows = np.arange(n).reshape(n, 1)
    X = B
    for i in (range(n) if lower else range(n - 1, -1, -1)):
        xi = _row(X, i)
        if not unit:
            xi = op.Div(xi, _entry(T, i, i))
        rest = rows > i if lower else rows < i
        eliminated = op.Sub(X, op.Mul(_col(T, i), xi))
        X = op.Where(_const(rest), eliminated, op.Where(_const(rows == i), xi, X))
    if n == 0:  # no step broadcast B against T's batch axes
        batch = op.Shape(op.Add(op.ReduceSum(T, _ints(-2, -1), keepdims=1),
                                op.ReduceSum(B, _ints(-2, -1), keepdims=1)), start=0, end=-2)
        X = op.Expand(B, op.Concat(batch, op.Shape(B, start=-2), axis=0))
    return X


def _solve_triangular(T, B, n, upper: bool, left: bool, unit: bool):
    """``T X = B`` (left) or ``X T = B`` (right)."""
    if left:
        return _trsm(T, B, n, lower=not upper, unit=unit)
    # X T = B  <=>  T^T X^T = B^T
    return _mT(_trsm(_mT(T), _mT(B), n, lower=upper, unit=unit))


def _lu_solve_left(LU, pivots0, B, n, adjoint: bool):
    """``A X = B`` or ``A^T X = B`` with ``A = P L U`` given as (LU, 0-based pivots)."""
    perm_t = _permutation_matrix(pivots0, LU, n)  # P^T
    if not adjoint:  # L U X = P^T B
        Y = _trsm(LU, op.MatMul(perm_t, B), n, lower=True, unit=True)
        return _trsm(LU, Y, n, lower=False, unit=False)
    # U^T L^T P^T X = B
    LU_t = _mT(LU)
    Y = _trsm(LU_t, B, n, lower=True, unit=False)
    Z = _trsm(LU_t, Y, n, lower=False, unit=True)
    return op.MatMul(_mT(perm_t), Z)


def _lu_solve(LU, pivots0, B, n, left: bool, adjoint: bool):
    if left:
        return _lu_solve_left(LU, pivots0, B, n, adjoint)
    # X A = B <=> A^T X^T = B^T ; X A^T = B <=> A X^T = B^T
    return _mT(_lu_solve_left(LU, pivots0, _mT(B), n, not adjoint))


def _identity(n, like):
    return op.CastLike(_const(np.eye(n, dtype=np.float64)), like)


def _int32(x):
    return op.Cast(x, to=_INT32)


def _pivots32(pivots0):
    return _int32(op.Add(pivots0, _const(np.int64(1))))


# ---- aten ops -----------------------------------------------------------------------------------

def aten_linalg_lu_factor_ex(A, pivot: bool = True, check_errors: bool = False):
    """linalg_lu_factor_ex(Tensor A, *, bool pivot=True, bool check_errors=False) -> (LU, pivots, info)."""
    if not pivot:
        raise NotImplementedError("LU without pivoting is left to PyTorch")
    m, n = _dims(A)
    LU, pivots0, info, _ = _lu(A, n, m)
    return LU, _pivots32(pivots0), _int32(info)


def _unpack(LU, pivots0, m, n, like):
    """(P, L, U) with A = P L U from a (..., m, n) LU and its 0-based pivots."""
    k = min(m, n)
    P = _mT(_permutation_matrix(pivots0, like, m, k))
    L = op.Slice(LU, _ints(0), _ints(k), _ints(-1))
    L = op.Where(_const(np.tri(m, k, -1, dtype=bool)), L, op.CastLike(_const(np.eye(m, k)), like))
    U = op.Slice(LU, _ints(0), _ints(k), _ints(-2))
    U = op.Where(_const(np.triu(np.ones((k, n), dtype=bool))), U, op.CastLike(_const(0.0), like))
    return P, L, U


def aten_linalg_lu(A, pivot: bool = True):
    """linalg_lu(Tensor A, *, bool pivot=True) -> (Tensor P, Tensor L, Tensor U)."""
    if not pivot:
        raise NotImplementedError("LU without pivoting is left to PyTorch")
    m, n = _dims(A)
    LU, pivots0, _, _ = _lu(A, n, m)
    return _unpack(LU, pivots0, m, n, A)


def aten_lu_unpack(LU_data, LU_pivots, unpack_data: bool = True, unpack_pivots: bool = True):
    """lu_unpack(Tensor LU_data, Tensor LU_pivots, bool unpack_data=True, bool unpack_pivots=True)
    -> (Tensor P, Tensor L, Tensor U); what is not unpacked is an empty (0,) tensor, as in eager."""
    m, n = _dims(LU_data)
    pivots0 = op.Sub(op.Cast(LU_pivots, to=_INT64), _const(np.int64(1)))
    P, L, U = _unpack(LU_data, pivots0, m, n, LU_data)
    empty = op.CastLike(op.ConstantOfShape(_ints(0)), LU_data)
    if not unpack_pivots:
        P = empty
    if not unpack_data:
        L, U = empty, op.Identity(empty)
    return P, L, U


def aten_linalg_inv_ex(A, check_errors: bool = False):
    """linalg_inv_ex(Tensor A, *, bool check_errors=False) -> (Tensor inverse, Tensor info)."""
    n = _size(A)
    LU, pivots0, info, _ = _lu(A, n)
    return _lu_solve_left(LU, pivots0, _identity(n, A), n, adjoint=False), _int32(info)


def _det_from_lu(LU, swaps, n):
    diagonal = [op.Squeeze(_entry(LU, i, i), _ints(-2, -1)) for i in range(n)]
    odd = op.Equal(op.Mod(swaps, _const(np.int64(2))), _const(np.int64(1)))
    return diagonal, odd


def _fake_tensor(value):
    """The FX fake tensor behind an ONNX value of the graph being exported (None if unknown)."""
    node = value.meta.get("node")
    index = 0
    if node is None and value.producer() is not None:
        node, index = value.producer().meta.get("node"), value.index()
    val = node.meta.get("val") if node is not None else None
    if isinstance(val, (tuple, list)):
        val = val[index] if index is not None and index < len(val) else None
    return val if isinstance(val, torch.Tensor) else None


def _lu_for_det(A, n):
    """The LU eager's _linalg_det/_linalg_slogdet return: of ``A^T`` when A is contiguous
    (a LAPACK-friendly layout), else of A. Their backward, traced from the same fake tensor,
    solves with ``adjoint = not A.is_contiguous()``, so the choice must follow A's strides."""
    fake = _fake_tensor(A)
    if fake is None:
        raise ValueError("the strides of det's input are unknown (they decide its LU's layout)")
    return _lu(_mT(A) if fake.is_contiguous() else A, n)


def aten__linalg_det(A):
    """_linalg_det(Tensor A) -> (Tensor result, Tensor LU, Tensor pivots)."""
    n = _size(A)
    LU, pivots0, _, swaps = _lu_for_det(A, n)
    diagonal, odd = _det_from_lu(LU, swaps, n)
    det = _batch_full(A, 1.0)
    for d in diagonal:
        det = op.Mul(det, d)
    det = op.Where(odd, op.Neg(det), det)
    return det, LU, _pivots32(pivots0)


def aten__linalg_slogdet(A):
    """_linalg_slogdet(Tensor A) -> (Tensor sign, Tensor logabsdet, Tensor LU, Tensor pivots)."""
    n = _size(A)
    LU, pivots0, _, swaps = _lu_for_det(A, n)
    diagonal, odd = _det_from_lu(LU, swaps, n)
    sign = _batch_full(A, 1.0)
    logabsdet = _batch_full(A, 0.0)
    for d in diagonal:
        sign = op.Mul(sign, op.Sign(d))
        logabsdet = op.Add(logabsdet, op.Log(op.Abs(d)))
    sign = op.Where(odd, op.Neg(sign), sign)
    return sign, logabsdet, LU, _pivots32(pivots0)


def aten_linalg_lu_solve(LU, pivots, B, left: bool = True, adjoint: bool = False):
    """linalg_lu_solve(Tensor LU, Tensor pivots, Tensor B, *, bool left=True, bool adjoint=False)."""
    n = _size(LU)
    pivots0 = op.Sub(op.Cast(pivots, to=_INT64), _const(np.int64(1)))
    return _lu_solve(LU, pivots0, B, n, left, adjoint)


def _is_vector_rhs(A, B) -> bool:
    """torch's linalg_solve_is_vector_rhs."""
    a_shape, b_shape = list(A.shape), list(B.shape)
    return len(b_shape) == 1 or (len(b_shape) == len(a_shape) - 1 and b_shape == a_shape[:-1])


def aten__linalg_solve_ex(A, B, left: bool = True, check_errors: bool = False):
    """_linalg_solve_ex(Tensor A, Tensor B, *, bool left=True, bool check_errors=False)
    -> (Tensor result, Tensor LU, Tensor pivots, Tensor info)."""
    n = _size(A)
    LU, pivots0, info, _ = _lu(A, n)
    if _is_vector_rhs(A, B):
        column = op.Unsqueeze(B, _ints(-1))
        result = op.Squeeze(_lu_solve(LU, pivots0, column, n, left, False), _ints(-1))
    else:
        result = _lu_solve(LU, pivots0, B, n, left, False)
    return result, LU, _pivots32(pivots0), _int32(info)


def aten_linalg_solve_triangular(A, B, upper: bool, left: bool = True, unitriangular: bool = False):
    """linalg_solve_triangular(Tensor self, Tensor B, *, bool upper, bool left=True,
    bool unitriangular=False)."""
    return _solve_triangular(A, B, _size(A), upper, left, unitriangular)


def aten_triangular_solve(self, A, upper: bool = True, transpose: bool = False,
                          unitriangular: bool = False):
    """triangular_solve(Tensor self, Tensor A, bool upper=True, bool transpose=False,
    bool unitriangular=False) -> (Tensor solution, Tensor cloned_coefficient)."""
    n = _size(A)
    T = _mT(A) if transpose else A
    solution = _trsm(T, self, n, lower=upper == transpose, unit=unitriangular)
    # cloned_coefficient is A broadcast to the common batch shape.
    batch = op.Shape(op.Add(op.Slice(A, _ints(0), _ints(1), _ints(-1)),
                            op.Slice(self, _ints(0), _ints(1), _ints(-1))), start=0, end=-2)
    coefficient = op.Expand(A, op.Concat(batch, op.Shape(A, start=-2), axis=0))
    return solution, coefficient


def _cholesky_solve(L, B, n, upper: bool):
    if upper:  # A = U^T U
        return _trsm(L, _trsm(_mT(L), B, n, lower=True, unit=False), n, lower=False, unit=False)
    # A = L L^T
    return _trsm(_mT(L), _trsm(L, B, n, lower=True, unit=False), n, lower=False, unit=False)


def aten_cholesky_solve(self, input2, upper: bool = False):
    """cholesky_solve(Tensor self, Tensor input2, bool upper=False): A X = self, A from its
    Cholesky factor ``input2``."""
    return _cholesky_solve(input2, self, _size(input2), upper)


def aten_cholesky_inverse(self, upper: bool = False):
    """cholesky_inverse(Tensor self, bool upper=False): the inverse of A from its Cholesky factor."""
    n = _size(self)
    return _cholesky_solve(self, _identity(n, self), n, upper)


# ---- Cholesky -----------------------------------------------------------------------------------

def _cholesky_lower(A, n):
    """(L, info int64) as LAPACK's left-looking potf2 on A's lower triangle. At the first
    non-positive (or nan) reduced diagonal ``ajj`` it stops, as LAPACK does: that column keeps
    ``ajj`` on the diagonal and A below it, later columns keep A (eager returns the same)."""
    rows = np.arange(n).reshape(n, 1)
    cols = np.arange(n).reshape(1, n)
    zero = op.CastLike(_const(0.0), A)
    info = _batch_zeros_int(A)
    done = op.Expand(zero, op.Shape(A))  # the finished columns of L, zero elsewhere
    out = A
    for j in range(n):
        # column j of A - L[:, :j] L[j, :j]^T
        reduced = op.Sub(_col(A, j), op.MatMul(done, _mT(_row(done, j))))
        ajj = _entry(reduced, j, 0)
        failed = op.Not(op.Greater(ajj, zero))  # ajj <= 0 or nan
        diag = op.Sqrt(op.Where(failed, op.CastLike(_const(1.0), A), ajj))
        column = op.Where(_const(rows == j), diag, op.Div(reduced, diag))
        ok = op.Equal(info, _const(np.int64(0)))
        fails_here = op.And(ok, op.Squeeze(failed, _ints(-2, -1)))
        info = op.Where(fails_here, _const(np.int64(j + 1)), info)
        keep = op.Unsqueeze(op.And(ok, op.Not(fails_here)), _ints(-1, -2))  # (..., 1, 1)
        stop = op.Unsqueeze(fails_here, _ints(-1, -2))
        at_j = _const(cols == j)
        out = op.Where(op.And(at_j, keep), column,
                       op.Where(op.And(op.And(at_j, _const(rows == j)), stop), ajj, out))
        done = op.Where(at_j, column, done)
    return op.Where(_const(rows >= cols), out, zero), info


def _cholesky(A, upper: bool):
    n = _size(A)
    if upper:  # LAPACK's 'U' reads A's upper triangle: U = (lower factor of A^T)^T
        L, info = _cholesky_lower(_mT(A), n)
        return _mT(L), info
    return _cholesky_lower(A, n)


def aten_linalg_cholesky_ex(self, upper: bool = False, check_errors: bool = False):
    """linalg_cholesky_ex(Tensor self, *, bool upper=False, bool check_errors=False) -> (L, info)."""
    L, info = _cholesky(self, upper)
    return L, _int32(info)


# ---- QR (Householder, as LAPACK's geqrf + orgqr) ------------------------------------------------

def _scaled_norm(x, axis: int):
    """Euclidean norm over ``axis`` (keepdims) without overflow or underflow in the squares."""
    scale = op.ReduceMax(op.Abs(x), _ints(axis), keepdims=1)
    safe = op.Where(op.Equal(scale, op.CastLike(_const(0.0), x)), op.CastLike(_const(1.0), x), scale)
    scaled = op.Div(x, safe)
    return op.Mul(scale, op.Sqrt(op.ReduceSum(op.Mul(scaled, scaled), _ints(axis), keepdims=1)))


def _geqrf(A, m, n):
    """(A with R on and above its diagonal, Householder vectors [(..., m, 1)], taus [(..., 1, 1)]).
    Each reflector as LAPACK's dlarfg: beta = -sign(alpha) * ||x||, tau = 0 when x[1:] is zero."""
    rows = np.arange(m).reshape(m, 1)
    cols = np.arange(n).reshape(1, n)
    zero, one = op.CastLike(_const(0.0), A), op.CastLike(_const(1.0), A)
    vectors, taus = [], []
    for j in range(min(m, n)):
        alpha = _entry(A, j, j)
        below = op.Where(_const(rows > j), _col(A, j), zero)
        xnorm = _scaled_norm(below, -2)
        trivial = op.Equal(xnorm, zero)
        norm = _scaled_norm(op.Concat(alpha, xnorm, axis=-2), -2)
        beta = op.Where(op.Less(alpha, zero), norm, op.Neg(norm))
        tau = op.Where(trivial, zero, op.Div(op.Sub(beta, alpha), beta))
        v = op.Div(below, op.Where(trivial, one, op.Sub(alpha, beta)))
        v = op.Where(_const(rows == j), one, v)
        beta = op.Where(trivial, alpha, beta)
        if j < n - 1:  # A[:, j+1:] -= tau v (v^T A[:, j+1:])
            reflected = op.Sub(A, op.Mul(op.Mul(tau, v), op.MatMul(_mT(v), A)))
            A = op.Where(_const(cols > j), reflected, A)
        A = op.Where(_const(cols == j), op.Where(_const(rows == j), beta, op.Where(_const(rows > j), v, A)), A)
        vectors.append(v)
        taus.append(tau)
    return A, vectors, taus


def _orgqr(vectors, taus, m, columns, batch_of, like):
    """H_0 H_1 ... H_{k-1} applied to the first ``columns`` columns of the m x m identity."""
    Q = op.CastLike(_const(np.eye(m, columns)), like)
    for v, tau in reversed(list(zip(vectors, taus))):
        Q = op.Sub(Q, op.Mul(op.Mul(tau, v), op.MatMul(_mT(v), Q)))
    return op.Expand(Q, op.Concat(op.Shape(batch_of, start=0, end=-2), _ints(m, columns), axis=0))


def aten_linalg_qr(A, mode: str = "reduced"):
    """linalg_qr(Tensor A, str mode="reduced") -> (Tensor Q, Tensor R)."""
    m, n = _dims(A)
    k = min(m, n)
    reduced, vectors, taus = _geqrf(A, m, n)
    r_rows = m if mode == "complete" else k
    R = op.Slice(reduced, _ints(0), _ints(r_rows), _ints(-2))
    R = op.Where(_const(np.triu(np.ones((r_rows, n), dtype=bool))), R, op.CastLike(_const(0.0), A))
    if mode == "r":
        Q = op.CastLike(op.ConstantOfShape(_ints(0)), A)
    elif mode in ("reduced", "complete"):
        Q = _orgqr(vectors, taus, m, m if mode == "complete" else k, A, A)
    else:
        raise ValueError(f"qr mode {mode!r}")
    return Q, R


def aten_linalg_householder_product(input, tau):
    """linalg_householder_product(Tensor input, Tensor tau): LAPACK's orgqr."""
    m, n = _dims(input)
    k = tau.shape[-1] if tau.shape is not None else None
    if not isinstance(k, int):
        raise ValueError("householder_product needs a static number of reflectors")
    rows = np.arange(m).reshape(m, 1)
    zero, one = op.CastLike(_const(0.0), input), op.CastLike(_const(1.0), input)
    vectors, taus = [], []
    for j in range(k):
        v = op.Where(_const(rows > j), _col(input, j), op.Where(_const(rows == j), one, zero))
        vectors.append(v)
        taus.append(op.Unsqueeze(op.Slice(tau, _ints(j), _ints(j + 1), _ints(-1)), _ints(-1)))
    return _orgqr(vectors, taus, m, n, input, input)  # torch requires tau's batch == input's


# ---- matrix exponential -------------------------------------------------------------------------

#: eager's (ATen mexp) norm bounds for its Taylor degrees 1, 2, 4, 8, 12, 18 (Bader, Blanes,
#: Casas 2019), per dtype: the same polynomial per norm and the same scaling and squaring.
_EXP_THETAS = {
    ir.DataType.FLOAT: (1.192092800768788e-07, 5.978858893805233e-04, 5.116619363445086e-02,
                        5.800524627688768e-01, 1.461661507209034e+00, 3.010066362817634e+00),
    ir.DataType.DOUBLE: (2.220446049250313e-16, 2.580956802971767e-08, 3.397168839976962e-04,
                         4.991228871115323e-02, 2.996158913811580e-01, 1.090863719290036e+00),
}
_T12_B = ((9.0198e-16, 0.46932117595418237389, -0.20099424927047284052, -0.04623946134063071740),
          (5.31597895759871264183, 1.19926790417132231573, 0.01179296240992997031, 0.01108844528519167989),
          (0.18188869982170434744, 0.05502798439925399070, 0.09351590770535414968, 0.00610700528898058230),
          (-2.0861320e-13, -0.13181061013830184015, -0.02027855540589259079, -0.00675951846863086359))
_T18_B = ((0., -1.00365581030144618291e-01, -8.02924648241156932449e-03, -8.92138498045729985177e-04, 0.),
          (0., 3.97849749499645077844e-01, 1.36783778460411720168e+00, 4.98289622525382669416e-01,
           -6.37898194594723280150e-04),
          (-1.09676396052962061844e+01, 1.68015813878906206114e+00, 5.71779846478865511061e-02,
           -6.98210122488052056106e-03, 3.34975017086070470649e-05),
          (-9.04316832390810593223e-02, -6.76404519071381882256e-02, 6.75961301770459654925e-02,
           2.95552570429315521194e-02, -1.39180257516060693404e-05),
          (0., 0., -9.23364619367118555360e-02, -1.69364939002081722752e-02, -1.40086798182036094347e-05))


def _combination(matrices, coefficients, np_type):
    """sum_j c_j * M_j, accumulated in order (as ATen's _compute_linear_combination)."""
    like = matrices[0]
    total = None
    for m, c in zip(matrices, coefficients):
        term = op.Mul(m, op.CastLike(_const(np_type(c)), like))
        total = term if total is None else op.Add(total, term)
    return total


def _exp_polynomials(A, identity, np_type):
    """ATen's T1, T2, T4, T8, T12 and T18 (degree-d Taylor polynomials of exp, in few products)."""
    A2 = op.MatMul(A, A)
    A3 = op.MatMul(A, A2)
    A6 = op.MatMul(A3, A3)
    t1 = op.Add(identity, A)
    t2 = op.Add(op.Add(identity, A), op.Div(A2, op.CastLike(_const(np_type(2.0)), A)))
    inner = _combination([identity, A, A2], (1 / 2.0, 1 / 6.0, 1 / 24.0), np_type)
    t4 = _combination([identity, A, op.MatMul(A2, inner)], (1.0, 1.0, 1.0), np_type)
    # T8, its constants as ATen computes them in the matrix dtype
    f = np_type
    sqrt_177 = f(0.1330413469565007072504e+2)
    x3 = f(2.0 / 3.0)
    x1 = f(float(x3) * ((1.0 + float(sqrt_177)) / 88.0))
    x2 = f(float(x3) * ((1.0 + float(sqrt_177)) / 352.0))
    x4 = f((-271.0 + 29.0 * float(sqrt_177)) / (315.0 * float(x3)))
    x5 = f((-11.0 + 11.0 * float(sqrt_177)) / (1260.0 * float(x3)))
    x6 = f((-99.0 + 11.0 * float(sqrt_177)) / (5040.0 * float(x3)))
    x7 = f((89.0 - float(sqrt_177)) / (5040.0 * float(x3)))
    y2 = f((857.0 - 58.0 * float(sqrt_177)) / 630.0)
    A4 = op.MatMul(A2, _combination([A, A2], (x1, x2), np_type))
    A8 = op.MatMul(_combination([A2, A4], (x3, 1.0), np_type),
                   _combination([identity, A, A2, A4], (x4, x5, x6, x7), np_type))
    t8 = _combination([identity, A, A2, A8], (1.0, 1.0, y2, 1.0), np_type)
    # T12
    b = [_combination([identity, A, A2, A3], row, np_type) for row in _T12_B]
    b2 = op.Add(b[2], op.MatMul(b[3], b[3]))
    t12 = op.Add(b[0], op.MatMul(op.Add(b[1], b2), b2))
    # T18
    b = [_combination([identity, A, A2, A3, A6], row, np_type) for row in _T18_B]
    a9 = op.Add(b[3], op.MatMul(b[0], b[4]))
    t18 = op.Add(b[1], op.MatMul(op.Add(b[2], a9), a9))
    return t1, t2, t4, t8, t12, t18


_LOOP_IDS = itertools.count()


def _square_loop(X, steps, dtype):
    """Square each matrix of X ``steps`` (int64 (..., 1, 1)) times: an ONNX Loop running
    max(steps) times, each batch element squaring while the iteration is below its count."""
    # Body values need model-wide unique names and typed inputs.
    uid = f"matrix_exp_loop{next(_LOOP_IDS)}"
    iteration = ir.Value(name=f"{uid}_iteration", type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape([]))
    cond_in = ir.Value(name=f"{uid}_cond_in", type=ir.TensorType(ir.DataType.BOOL), shape=ir.Shape([]))
    carried = ir.Value(name=f"{uid}_x_in", type=ir.TensorType(dtype))
    less = ir.node("Less", [iteration, steps])
    square = ir.node("MatMul", [carried, carried])
    chosen = ir.node("Where", [less.outputs[0], square.outputs[0], carried])
    cond_out = ir.node("Identity", [cond_in])
    body = ir.Graph([iteration, cond_in, carried], [cond_out.outputs[0], chosen.outputs[0]],
                    nodes=[less, square, chosen, cond_out], name=uid)
    for i, value in enumerate([*less.outputs, *square.outputs, *chosen.outputs, *cond_out.outputs]):
        value.name = f"{uid}_{i}"
    # max over the batch; the extra 0 keeps an empty batch from reducing to nothing
    trips = op.ReduceMax(op.Concat(op.Reshape(steps, _ints(-1)), _ints(0), axis=0), keepdims=0)
    # By keyword: torch's op recorder hands a variadic input all positional arguments
    # (M and cond again), and opset18.Loop takes v_initial only positionally.
    loop = Op(op, "Loop", onnx.defs.get_schema("Loop", 16, ""))
    return loop(M=trips, cond=op.Constant(value=ir.tensor(np.array(True))), v_initial=[X], body=body)


def aten_linalg_matrix_exp(self):
    """linalg_matrix_exp(Tensor self), as ATen computes it: by the 1-norm, one of six Taylor
    polynomials, the largest after scaling by 2^-s and followed by s squarings."""
    if self.shape is None or not isinstance(self.shape[-1], int):
        raise ValueError("matrix_exp needs a static matrix size")
    n = self.shape[-1]
    if n == 1:
        return op.Exp(self)
    thetas = _EXP_THETAS.get(self.dtype)
    if thetas is None:
        raise TypeError(f"matrix_exp is lowered for float32/float64 only, not {self.dtype}")
    np_type = np.float32 if self.dtype == ir.DataType.FLOAT else np.float64

    def const(value):
        return op.CastLike(_const(np_type(value)), self)

    zero = const(0.0)
    norm = op.ReduceMax(op.ReduceSum(op.Abs(self), _ints(-2), keepdims=1), _ints(-1), keepdims=1)
    large = op.GreaterOrEqual(norm, const(thetas[4]))
    steps = op.Max(zero, op.Ceil(op.Div(op.Log(op.Div(norm, const(thetas[5]))), const(np.log(2.0)))))
    # only the T18 branch scales; an inf norm gives inf/nan as in eager, never a huge loop
    steps = op.Where(op.And(large, op.Less(norm, const(np.inf))), steps, zero)
    scaled = op.Div(self, op.Pow(const(2.0), steps))
    identity = _identity(n, self)
    *small, _ = _exp_polynomials(self, identity, np_type)
    t18 = _exp_polynomials(scaled, identity, np_type)[-1]
    result = _square_loop(t18, op.Cast(steps, to=_INT64), self.dtype)
    for i, (theta, polynomial) in reversed(list(enumerate(zip(thetas[:5], small)))):
        # eager: degree i for norms in (theta[i-1], theta[i]], but T18 from theta[4] on
        below = op.Less if i == 4 else op.LessOrEqual
        result = op.Where(below(norm, const(theta)), polynomial, result)
    return result


LOWERINGS = {
    aten.linalg_lu_factor_ex.default: aten_linalg_lu_factor_ex,
    aten.linalg_inv_ex.default: aten_linalg_inv_ex,
    aten._linalg_det.default: aten__linalg_det,
    aten._linalg_slogdet.default: aten__linalg_slogdet,
    aten.linalg_lu_solve.default: aten_linalg_lu_solve,
    aten._linalg_solve_ex.default: aten__linalg_solve_ex,
    aten.linalg_solve_triangular.default: aten_linalg_solve_triangular,
    aten.triangular_solve.default: aten_triangular_solve,
    aten.cholesky_solve.default: aten_cholesky_solve,
    aten.cholesky_inverse.default: aten_cholesky_inverse,
    aten.linalg_lu.default: aten_linalg_lu,
    aten.lu_unpack.default: aten_lu_unpack,
    aten.linalg_cholesky_ex.default: aten_linalg_cholesky_ex,
    aten.linalg_qr.default: aten_linalg_qr,
    aten.linalg_householder_product.default: aten_linalg_householder_product,
    aten.linalg_matrix_exp.default: aten_linalg_matrix_exp,
}

#: LAPACK-style algorithms in the input's own precision: as accurate as eager for float32
#: and float64; half precision (which eager's CPU linalg rejects anyway) stays in PyTorch.
ACCURATE_DTYPES = {target: (torch.float32, torch.float64) for target in LOWERINGS}
