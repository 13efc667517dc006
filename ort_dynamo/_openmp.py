"""PyTorch's OpenMP threads as the compute threads of CPU sessions (option ``cpu_thread_pool``).

ORT's intra-op threads never spin (``run.session_options``), so every parallel op in a session
wakes them; PyTorch's OpenMP threads (GNU OpenMP, libgomp, in torch's Linux builds) spin a while
after each op by default. Eager's ops find them awake, and when ORT's threads run next to them,
the spinning ones take cores from ORT's. A session of this mode runs on one thread: its products
are torch's BLAS, threaded by it on the OpenMP threads (``csrc/torch_blas.c``'s ``torch_threads``),
and its kernels come from the library flavor whose tasks go to the same threads
(``csrc/pointwise_runtime.c``, ``PW_OPENMP``). The rest of ORT's ops run on the calling thread.
"""

from __future__ import annotations

import functools
import os

from . import _kernels, _torch_blas
from .options import OrtOptions

__all__ = ["applies", "describe", "problem"]

_LIBGOMP = "libgomp.so.1"
#: ORT's own ops that thread their work and would run on one thread here (ORT's domain; the
#: Microsoft one's products). Left in a graph, ``auto`` keeps ORT's threads.
THREADED_ORT_OPS = frozenset({"Conv", "ConvTranspose", "MatMul", "Gemm", "FusedMatMul", "FusedGemm", "Einsum",
                              "LSTM", "GRU", "RNN", "MaxPool", "AveragePool", "MatMulInteger", "ConvInteger",
                              "QLinearConv", "QLinearMatMul", "Attention", "MultiHeadAttention"})


@functools.lru_cache(None)
def problem() -> str:
    """Why PyTorch's OpenMP threads cannot run ORT's work here, or "" if they can."""
    import torch

    if not torch.backends.openmp.is_available():
        return "this torch is built without OpenMP"
    try:
        with open("/proc/self/maps") as fh:
            loaded = any(line.rstrip().endswith("/" + _LIBGOMP) for line in fh)
    except OSError:
        return "no /proc/self/maps to find torch's OpenMP library in"
    if not loaded:
        return f"torch's OpenMP is not GNU OpenMP ({_LIBGOMP} is not loaded)"
    if not _kernels.available():
        return "the pointwise kernels cannot be built here (no C compiler)"
    return ""


def _passive() -> bool:
    return os.environ.get("OMP_WAIT_POLICY", "").strip().lower() == "passive"


def applies(options: OrtOptions, device: str, op_types: set[tuple[str, str]] = frozenset(),
            kernels: bool = True, products: bool = True) -> bool:
    """Whether a graph on ``device`` runs on PyTorch's OpenMP threads. ``op_types``: its nodes'
    (domain, op type) after the products went to torch's BLAS; ``auto`` asks that none of ORT's
    threaded ops is left, and that the graph gets its pointwise kernels (``kernels``).
    ``products``: the graph may multiply matrices, so torch's BLAS must apply (an optimizer's
    graph does not). Says once why an explicit ``torch`` cannot apply."""
    if device != "cpu" or options.cpu_thread_pool == "ort":
        return False
    asked = options.cpu_thread_pool == "torch"
    if reason := problem() or ("torch's BLAS does not apply" if products and not _torch_blas.applies(options, device)
                               else ""):
        if asked:
            _torch_blas._warn_once(f"ort_dynamo: cpu_thread_pool='torch' cannot apply, ORT's threads run "
                                   f"the sessions: {reason}")
        return False
    if asked:
        return True
    if options.intra_op_num_threads or _passive() or not kernels:
        return False
    return not any(domain in ("", "ai.onnx", "com.microsoft") and op in THREADED_ORT_OPS for domain, op in op_types)


def describe() -> str:
    """One line for ``python -m ort_dynamo info``: whose threads run CPU sessions by default."""
    if reason := problem():
        return f"ORT's ({reason})"
    if _passive():
        return "ORT's (OMP_WAIT_POLICY=PASSIVE: PyTorch's threads sleep between ops too)"
    if not _torch_blas.applies(OrtOptions(), "cpu"):
        return "ORT's (products stay on MLAS here: cpu_matmul)"
    return "PyTorch's OpenMP threads, for graphs without ORT's threaded ops (convolutions, RNNs)"
