"""Where ORT's CUDA sessions get memory: PyTorch's caching allocator, or one ORT arena per GPU.

With two pools on one GPU, each keeps the peak it once reached: ORT's arena holds the
activations of the forward and the gradients of the backward, PyTorch's the rest, and neither
can reuse what the other has cached. Through PyTorch's allocator there is one pool, as
ORTModule had it (it gave ORT PyTorch's allocator as ``gpu_external_alloc``): GPT-2 124M's step
on an H100 peaked at 9.6 GB so, 12.0 GB with one ORT arena, 6.9 GB in eager. The allocator is
registered with ORT's environment, once per GPU, and every session takes it
(``session.use_env_allocators``)."""

from __future__ import annotations

import ctypes
import logging
import os

import onnxruntime as ort

from . import _kernels

__all__ = ["register", "registered", "torch_allocator_problem", "refused_bytes"]

log = logging.getLogger("ort_dynamo")

_SOURCE = os.path.join(_kernels._CSRC, "torch_cuda_allocator.c")
_SHIM = ("aoti_torch_cuda_caching_allocator_raw_alloc", "aoti_torch_cuda_caching_allocator_raw_delete")

#: What each GPU's sessions allocate from, once registered: "pytorch", "shared_arena" or
#: "per_session" (by device index).
_registered: dict[int, str] = {}
#: The adapter library each GPU's sessions allocate through, where that is PyTorch's allocator.
_adapters: dict[int, ctypes.CDLL] = {}


def registered(device_index: int) -> str:
    """What the sessions on GPU ``device_index`` allocate from ("" before the first session)."""
    return _registered.get(device_index, "")


def register(device_index: int, wanted: str, cache_dir: str = "") -> str:
    """Register ``wanted`` ("pytorch", "shared_arena" or "per_session": the ``cuda_allocator``
    option) for GPU ``device_index``, the first time a session is made there; returns what its
    sessions use. The choice holds for the process: ORT's environment keeps one allocator per
    device. Where PyTorch's allocator cannot be had (a warning says why), the shared arena."""
    if device_index in _registered:
        if _registered[device_index] != wanted:
            log.info("ort_dynamo: cuda_allocator=%r asked, but GPU %d's sessions already use %r (the "
                     "first CUDA session's choice holds for the process)", wanted, device_index,
                     _registered[device_index])
        return _registered[device_index]
    got = wanted
    if wanted == "pytorch":
        try:
            _register_pytorch(device_index, cache_dir)
        except Exception as exc:  # noqa: BLE001 - any failure means: the shared arena instead
            log.warning("ort_dynamo: ORT cannot allocate from PyTorch's CUDA allocator (%s); its sessions "
                        "share one ORT arena instead, beside PyTorch's pool", exc)
            got = "shared_arena"
    if got == "shared_arena":
        try:
            _register_shared_arena(device_index)
        except Exception as exc:  # noqa: BLE001 - sessions then use their own arenas
            log.warning("ort_dynamo: shared CUDA arena not registered, each session keeps its own (%s)", exc)
            got = "per_session"
    _registered[device_index] = got
    return got


def _memory_info(device_index: int) -> "ort.OrtMemoryInfo":
    return ort.OrtMemoryInfo("Cuda", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, device_index, ort.OrtMemType.DEFAULT)


def _register_shared_arena(device_index: int) -> None:
    """One ORT arena for all sessions on the GPU. It grows by what is asked (kSameAsRequested):
    doubling regions would leave up to half of a GPU's arena unused."""
    ort.create_and_register_allocator_v2("CUDAExecutionProvider", _memory_info(device_index),
                                         {"device_id": str(device_index)},
                                         ort.OrtArenaCfg({"arena_extend_strategy": 1}))


def _register_pytorch(device_index: int, cache_dir: str) -> None:
    """PyTorch's caching allocator as the GPU's allocator of all sessions. It allocates on the
    calling thread's current stream, which is the stream ORT runs on (``run.compute_stream``),
    so a block ORT frees is reused in that stream's order, as PyTorch's own are."""
    problem = torch_allocator_problem()
    if problem:
        raise RuntimeError(problem)
    adapter = _adapter(cache_dir)
    shim = _kernels.torch_library("libtorch_cuda.so")
    adapter.ortd_torch_allocator_init(*(ctypes.cast(getattr(shim, name), ctypes.c_void_p) for name in _SHIM))
    address = {name: ctypes.cast(getattr(adapter, name), ctypes.c_void_p).value
               for name in ("ortd_torch_alloc", "ortd_torch_free")}
    options = {"device_id": str(device_index), "gpu_external_alloc": str(address["ortd_torch_alloc"]),
               "gpu_external_free": str(address["ortd_torch_free"])}
    ort.create_and_register_allocator_v2("CUDAExecutionProvider", _memory_info(device_index), options,
                                         ort.OrtArenaCfg({}))
    _adapters[device_index] = adapter


def torch_allocator_problem() -> str:
    """Why ORT cannot allocate from PyTorch's CUDA allocator here, or "" if it can."""
    import torch

    if not torch.cuda.is_available():
        return "this torch has no CUDA"
    return _kernels.torch_shim_problem("libtorch_cuda.so", _SHIM, "the allocator adapter")


def _adapter(cache_dir: str = "") -> ctypes.CDLL:
    """The compiled ``csrc/torch_cuda_allocator.c`` (built once, kept on disk by its hash), loaded."""
    lib = ctypes.CDLL(adapter_path(cache_dir))
    lib.ortd_torch_allocator_init.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.ortd_torch_allocator_init.restype = None
    lib.ortd_torch_alloc.argtypes = [ctypes.c_size_t]
    lib.ortd_torch_alloc.restype = ctypes.c_void_p
    lib.ortd_torch_free.argtypes = [ctypes.c_void_p]
    lib.ortd_torch_free.restype = None
    lib.ortd_torch_refused_bytes.argtypes = []
    lib.ortd_torch_refused_bytes.restype = ctypes.c_uint64
    return lib


def adapter_path(cache_dir: str = "") -> str:
    """Path of the compiled adapter; built here if no earlier process left it."""
    return _kernels.built_host_library("torch_cuda_allocator", [_SOURCE], cache_dir)


def refused_bytes(device_index: int) -> int:
    """The size of the last allocation PyTorch's allocator refused ORT, and forget it; 0 if none
    (or if GPU ``device_index``'s sessions use an ORT arena)."""
    adapter = _adapters.get(device_index)
    return int(adapter.ortd_torch_refused_bytes()) if adapter is not None else 0
