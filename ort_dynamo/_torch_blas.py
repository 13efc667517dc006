"""PyTorch's BLAS for matrix products inside ORT sessions (option ``cpu_matmul``).

``csrc/torch_blas.c`` is a custom-op library (domain ``ort_dynamo.blas``) whose ``MatMul`` calls
the ``sgemm_`` torch exports (MKL in its x86 builds): eager's own product, inside the partition;
its ``Bf16MatMul``, MKL's bfloat16 product (CPU autocast's; AMX where the CPU has it).
Built once per machine with the C compiler (kept on disk by the hash of ``csrc``'s files) and
handed torch's function when first loaded."""

from __future__ import annotations

import ctypes
import functools
import os

from . import _kernels
from .options import OrtOptions
from .partition import warn_once

__all__ = ["DOMAIN", "applies", "bfloat16_products", "describe", "library", "problem"]

DOMAIN = "ort_dynamo.blas"
_SOURCE = os.path.join(_kernels._CSRC, "torch_blas.c")
_SGEMM = "sgemm_"
#: MKL's product of bfloat16 matrices into float32 (Fortran's interface, as sgemm_): CPU
#: autocast's products, on AMX where the CPU has it. Other BLAS lack it.
_BF16_GEMM = "gemm_bf16bf16f32_"
#: MKL's: a product kept to the calling thread, so it runs on ORT's threads (absent: OpenMP's).
_THREADS_LOCAL = "MKL_Set_Num_Threads_Local"  # by value (the lowercase names are Fortran's)
#: MKL's batch of products in one call, spread over its threads (eager's bmm on CPU).
_SGEMM_BATCH = "sgemm_batch_"


@functools.lru_cache(None)
def problem() -> str:
    """Why torch's BLAS cannot run inside ORT here, or "" if it can."""
    return _kernels.torch_shim_problem("libtorch_cpu.so", (_SGEMM,), "its BLAS products' custom-op library")


@functools.lru_cache(None)
def _mkl_first() -> bool:
    """Whether MKL's products are this CPU's fastest: torch has MKL, and the CPU is Intel's, or
    has no AVX-512 (MKL's AVX2 kernels then, as MLAS's; AMD's AVX-512 CPUs get MKL's AVX2 ones
    only, where MLAS uses AVX-512)."""
    import torch

    target = _kernels._target()
    return torch.backends.mkl.is_available() and ("GenuineIntel" in target or " avx512f" not in target)


def applies(options: OrtOptions, device: str) -> bool:
    """Whether a graph on ``device`` gets torch's BLAS for its products."""
    if device != "cpu" or options.cpu_matmul == "ort" or options.deterministic_compute:
        return False
    if options.cpu_matmul == "auto" and not _mkl_first() and options.cpu_thread_pool != "torch":
        return False
    if problem():
        if options.cpu_matmul == "torch_blas":
            warn_once(f"ort_dynamo: cpu_matmul='torch_blas' cannot apply, ORT multiplies instead: {problem()}")
        return False
    try:
        library(options.cache_dir)  # built once per machine: a model must not name ops nothing registers
    except _kernels.KernelBuildError as exc:
        warn_once(f"ort_dynamo: torch's BLAS products could not be built, ORT multiplies instead: {exc}")
        return False
    return True


@functools.lru_cache(None)
def bfloat16_products() -> bool:
    """Whether torch's BLAS multiplies bfloat16 matrices too (MKL's gemm_bf16bf16f32)."""
    try:
        getattr(_kernels.torch_library("libtorch_cpu.so"), _BF16_GEMM)
    except (OSError, AttributeError):
        return False
    return True


def describe() -> str:
    """One line for ``python -m ort_dynamo info``: who multiplies matrices by default."""
    if problem():
        return f"ORT's (torch's BLAS cannot run inside ORT: {problem()})"
    if _mkl_first():
        return "torch's BLAS (MKL" + ("; bfloat16 ones too)" if bfloat16_products() else ")")
    return ("ORT's (torch's BLAS is taken by default where torch has MKL and the CPU is Intel's or has no "
            "AVX-512; cpu_matmul=torch_blas forces it)")


def _usable_cpus() -> int:
    """CPUs this process may run on (a container's share, not the host's count): the pieces a
    product is cut into, one per thread of ORT's pool."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


@functools.lru_cache(None)
def library(cache_dir: str = "") -> str:
    """Path of the custom-op library, built here if no earlier process left it, and handed
    torch's ``sgemm_`` (the same loaded copy ORT registers: one path, one handle)."""
    if reason := problem():
        raise _kernels.KernelBuildError(reason)
    path = _kernels.built_host_library("torch_blas", [_SOURCE], cache_dir)
    hand_in(path, _usable_cpus())
    return path


def hand_in(path: str, pieces: int) -> None:
    """Give the loaded library at ``path`` torch's BLAS functions, and the number of pieces a
    product is cut into for ORT's threads (1: MKL threads each product itself;
    benchmarks/blas_pieces.py compares the two)."""
    loaded = ctypes.CDLL(path)
    torch_cpu = _kernels.torch_library("libtorch_cpu.so")
    sgemm = ctypes.cast(getattr(torch_cpu, _SGEMM), ctypes.c_void_p)
    optional = [ctypes.cast(getattr(torch_cpu, name, None) or 0, ctypes.c_void_p)
                for name in (_BF16_GEMM, _THREADS_LOCAL, _SGEMM_BATCH)]
    loaded.ortd_torch_blas_init.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64]
    loaded.ortd_torch_blas_init(sgemm, *optional, pieces)
