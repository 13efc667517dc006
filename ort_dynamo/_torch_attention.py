"""PyTorch's fused CPU attention inside ORT sessions (option ``cpu_torch_attention``).

``csrc/torch_attention.c`` is a custom-op library (domain ``ort_dynamo.torch``) whose two ops call
torch's flash attention for CPU, forward and backward, through torch's stable C shim. Attention
then runs as eager runs it, inside the partition, instead of as ORT's products and softmax. The
library is built once per machine with the C compiler (kept on disk by the hash of ``csrc``'s
files, ``_kernels.built_host_library``) and handed the shim's functions when first loaded."""

from __future__ import annotations

import ctypes
import functools
import os

from . import _kernels

__all__ = ["DOMAIN", "problem", "library"]

DOMAIN = "ort_dynamo.torch"
_SOURCE = os.path.join(_kernels._CSRC, "torch_attention.c")
#: The shim's functions the library calls, in the order ``ortd_torch_attention_init`` takes them.
_SHIM = ("aoti_torch_create_tensor_from_blob", "aoti_torch_delete_tensor_object", "aoti_torch_copy_",
         "aoti_torch_cpu__scaled_dot_product_flash_attention_for_cpu",
         "aoti_torch_cpu__scaled_dot_product_flash_attention_for_cpu_backward")
_CODES = ("aoti_torch_dtype_float32", "aoti_torch_dtype_bool", "aoti_torch_device_type_cpu")


@functools.lru_cache(None)
def problem() -> str:
    """Why torch's attention cannot run inside ORT here, or "" if it can."""
    return _kernels.torch_shim_problem("libtorch_cpu.so", (*_SHIM, *_CODES), "its attention's custom-op library")


@functools.lru_cache(None)
def library(cache_dir: str = "") -> str:
    """Path of the custom-op library, built here if no earlier process left it, and handed the
    shim's functions (the same loaded copy ORT registers: one path, one handle)."""
    if reason := problem():
        raise _kernels.KernelBuildError(reason)
    path = _kernels.built_host_library("torch_attention", [_SOURCE], cache_dir)
    loaded = ctypes.CDLL(path)
    torch_cpu = _kernels.torch_library("libtorch_cpu.so")
    functions = (ctypes.c_void_p * len(_SHIM))(*(ctypes.cast(getattr(torch_cpu, n), ctypes.c_void_p) for n in _SHIM))
    codes = []
    for name in _CODES:
        getter = getattr(torch_cpu, name)
        getter.restype = ctypes.c_int32
        codes.append(getter())
    loaded.ortd_torch_attention_init.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32]
    loaded.ortd_torch_attention_init(functions, *codes)
    return path
