"""NVRTC, CUDA's run-time compiler, through ctypes: CUDA C -> a binary for this machine's GPU.

CUDA builds of torch depend on NVRTC's wheel (``nvidia-cuda-nvrtc``), so a machine that trains
on a GPU has it without a CUDA toolkit; nothing here needs ``nvcc``. Found in that wheel's
folder on ``sys.path``, else by the loader's usual search.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import glob
import os
import sys

__all__ = ["NvrtcError", "available", "compile_cuda", "version"]


class NvrtcError(RuntimeError):
    """NVRTC is missing, or refused the source (its log is in the message)."""


def _candidates() -> list[str]:
    found = []
    for folder in sys.path:
        for pattern in ("nvidia/*/lib/libnvrtc.so*", "nvidia/cuda_nvrtc/lib/libnvrtc.so*"):
            found += sorted(p for p in glob.glob(os.path.join(folder or ".", pattern)) if "builtins" not in p)
    return [*dict.fromkeys(found), *filter(None, [ctypes.util.find_library("nvrtc")]),
            "libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"]


@functools.lru_cache(None)
def _library() -> ctypes.CDLL | None:
    for path in _candidates():
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        if hasattr(lib, "nvrtcGetCUBIN"):
            return lib
    return None


def available() -> bool:
    return _library() is not None


def version() -> str:
    lib = _library()
    if lib is None:
        return "none"
    major, minor = ctypes.c_int(), ctypes.c_int()
    lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return f"{major.value}.{minor.value}"


def compile_cuda(source: str, arch: str, headers: dict[str, str], name: str = "kernels.cu") -> bytes:
    """A cubin for ``arch`` (``"sm_90"``) of ``source``, whose ``#include "x"`` lines find ``headers``
    (name -> text). Float arithmetic as written: no fused multiply-add, no fast math."""
    lib = _library()
    if lib is None:
        raise NvrtcError("NVRTC not found (the nvidia-cuda-nvrtc wheel CUDA builds of torch install)")
    program = ctypes.c_void_p()
    names = (ctypes.c_char_p * len(headers))(*[k.encode() for k in headers])
    texts = (ctypes.c_char_p * len(headers))(*[v.encode() for v in headers.values()])
    _check(lib, lib.nvrtcCreateProgram(ctypes.byref(program), source.encode(), name.encode(), len(headers),
                                       texts, names), "nvrtcCreateProgram")
    try:
        options = [f"--gpu-architecture={arch}", "--std=c++17", "--fmad=false", "-default-device"]
        array = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
        if lib.nvrtcCompileProgram(program, len(options), array) != 0:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(program, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(program, log)
            raise NvrtcError(f"NVRTC {version()} refused the kernels for {arch}:\n"
                             f"{log.value.decode(errors='replace')[-3000:]}")
        size = ctypes.c_size_t()
        _check(lib, lib.nvrtcGetCUBINSize(program, ctypes.byref(size)), "nvrtcGetCUBINSize")
        cubin = ctypes.create_string_buffer(size.value)
        _check(lib, lib.nvrtcGetCUBIN(program, cubin), "nvrtcGetCUBIN")
        return cubin.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(program))


def _check(lib: ctypes.CDLL, rc: int, what: str) -> None:
    if rc != 0:
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        raise NvrtcError(f"{what} failed: {lib.nvrtcGetErrorString(rc).decode()}")
