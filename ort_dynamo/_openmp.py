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
import math
import os

from . import _kernels, _torch_blas
from .options import OrtOptions
from .partition import warn_once

__all__ = ["applies", "describe", "problem", "threaded_ort_share"]

_LIBGOMP = "libgomp.so.1"
#: ORT's own ops that thread their work and would run on one thread here (ORT's domain; the
#: Microsoft one's products and attention).
THREADED_ORT_OPS = frozenset({"Conv", "ConvTranspose", "MatMul", "Gemm", "FusedMatMul", "FusedGemm", "Einsum",
                              "LSTM", "GRU", "RNN", "MaxPool", "AveragePool", "MatMulInteger", "ConvInteger",
                              "QLinearConv", "QLinearMatMul", "Attention", "MultiHeadAttention"})
#: ``auto`` takes PyTorch's threads while ORT's threaded ops do at most this share of the graph's
#: multiply-adds (theirs and torch's BLAS products'). A ViT's patch convolution is a few percent:
#: on one thread it costs less than the wake-ups the pool saves (the tiny ViT of
#: benchmarks/hf_models.py: 0.77 of the step on ORT's threads); a ResNet's convolutions are all of it.
MAX_THREADED_ORT_SHARE = 0.2
#: A symbolic dimension's size in that estimate (a batch or a sequence: both sides have them).
_SYMBOLIC_SIZE = 8
_CONVOLUTIONS = frozenset({"Conv", "ConvInteger", "QLinearConv"})
_PRODUCTS = frozenset({"MatMul", "Gemm", "FusedMatMul", "FusedGemm", "MatMulInteger"})


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


def _size(dims) -> float:
    """The product of ``dims``, a symbolic one counted as ``_SYMBOLIC_SIZE``."""
    return math.prod(d if isinstance(d, int) else _SYMBOLIC_SIZE for d in dims)


def _numel(value) -> float:
    if value is None or value.shape is None:
        return math.inf
    return _size(value.shape)


def _inner(value, axis: int) -> float:
    """The size of ``value``'s ``axis`` (a product's summed axis), inf where unknown."""
    if value is None or value.shape is None or len(value.shape) < -axis:
        return math.inf
    return _size([value.shape[axis]])


def _per_output(weight) -> float:
    """Multiply-adds per output value of a convolution with ``weight`` (out or in channels first,
    then the rest: its other axes' sizes), inf where unknown."""
    if weight is None or weight.shape is None or len(weight.shape) < 2:
        return math.inf
    return _size(weight.shape[1:])


def _multiply_adds(node) -> float:
    """About how many multiply-adds ``node`` (a product, a convolution, a pooling of ORT's or a
    product of torch's BLAS) does; inf where its shapes or its kind do not say (an RNN, an
    Einsum, attention): ``auto`` then keeps ORT's threads."""
    out = node.outputs[0] if node.outputs else None
    if node.op_type in _CONVOLUTIONS:
        return _numel(out) * _per_output(node.inputs[3 if node.op_type == "QLinearConv" else 1])
    if node.op_type == "ConvTranspose":  # per input value: its weight is [in, out / groups, ...]
        return _numel(node.inputs[0]) * _per_output(node.inputs[1])
    if node.op_type in ("MaxPool", "AveragePool"):
        kernel = node.attributes.get_ints("kernel_shape", None)
        return _numel(out) * (math.prod(kernel) if kernel else math.inf)
    if node.op_type in _PRODUCTS or node.op_type == "Bf16MatMul":
        a = node.inputs[0]
        trans = node.attributes.get_int("transA", node.attributes.get_int("trans_a", 0))
        return _numel(out) * _inner(a, -2 if trans else -1)
    return math.inf


def threaded_ort_share(nodes, products_domain: str) -> float:
    """The share of the multiply-adds of ``nodes`` (a graph's, after the rewrites) that ORT's
    own threaded ops do, against those of the products of ``products_domain`` (torch's BLAS)."""
    own = sum(_multiply_adds(n) for n in nodes if n.domain in ("", "ai.onnx", "com.microsoft")
              and n.op_type in THREADED_ORT_OPS)
    if own == 0:
        return 0.0
    theirs = sum(_multiply_adds(n) for n in nodes if n.domain == products_domain)
    if math.isinf(own) or math.isnan(theirs):
        return 1.0
    return own / (own + theirs) if not math.isinf(theirs) else 0.0


def applies(options: OrtOptions, device: str, threaded_share: float = 0.0, kernels: bool = True,
            products: bool = True) -> bool:
    """Whether a graph on ``device`` runs on PyTorch's OpenMP threads. ``threaded_share``: the
    share of its multiply-adds left to ORT's own threaded ops (``threaded_ort_share``); ``auto``
    asks that it be small, and that the graph gets its pointwise kernels (``kernels``).
    ``products``: the graph may multiply matrices, so torch's BLAS must apply (an optimizer's
    graph does not). Says once why an explicit ``torch`` cannot apply."""
    if device != "cpu" or options.cpu_thread_pool == "ort":
        return False
    asked = options.cpu_thread_pool == "torch"
    if reason := problem() or ("torch's BLAS does not apply" if products and not _torch_blas.applies(options, device)
                               else ""):
        if asked:
            warn_once(f"ort_dynamo: cpu_thread_pool='torch' cannot apply, ORT's threads run the sessions: "
                      f"{reason}", stacklevel=2)
        return False
    if asked:
        return True
    if options.intra_op_num_threads or _passive() or not kernels:
        return False
    return threaded_share <= MAX_THREADED_ORT_SHARE


def describe() -> str:
    """One line for ``python -m ort_dynamo info``: whose threads run CPU sessions by default."""
    if reason := problem():
        return f"ORT's ({reason})"
    if _passive():
        return "ORT's (OMP_WAIT_POLICY=PASSIVE: PyTorch's threads sleep between ops too)"
    if not _torch_blas.applies(OrtOptions(), "cpu"):
        return "ORT's (products stay on MLAS here: cpu_matmul)"
    return (f"PyTorch's OpenMP threads, for graphs whose convolutions and other ops ORT threads itself do at "
            f"most {MAX_THREADED_ORT_SHARE:.0%} of the multiply-adds")
