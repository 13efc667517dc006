"""Kernels: generated C (``_pointwise``) -> an ONNX Runtime custom-op library.

Compiled with the machine's C compiler (``$CC``, else ``cc``/``gcc``) for this CPU, once per
source: libraries are kept on disk under ``<cache_dir>/kernels`` (or the user's cache folder,
``$XDG_CACHE_HOME/ort_dynamo/kernels``) by the hash of everything that shapes them. Stock
onnxruntime ships no C headers; ``csrc/ort_abi.h`` declares the few parts of its stable C ABI
the library uses.
"""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile

__all__ = ["available", "build", "library", "KernelBuildError"]

log = logging.getLogger("ort_dynamo")

_CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
# No -ffast-math: results must match op-by-op float32 arithmetic. -fno-math-errno lets the
# vectorizer use libmvec's SIMD expf/tanhf/erff (declared in pointwise.h).
# -fopenmp-simd: only the `omp simd` pragmas of row sums (vectorized partial sums); no OpenMP runtime.
_FLAGS = ["-O3", "-march=native", "-std=gnu11", "-fPIC", "-shared", "-fno-math-errno", "-ffp-contract=off",
          "-fopenmp-simd", "-fvisibility=hidden", "-w"]
_LIBS = ["-lmvec", "-lm"]


class KernelBuildError(RuntimeError):
    """The generated kernels could not be compiled."""


@functools.lru_cache(None)
def _compiler() -> tuple[str, str] | None:
    """(path, version line) of the C compiler, or None."""
    for name in filter(None, (os.environ.get("CC"), "cc", "gcc", "clang")):
        path = shutil.which(name)
        if path:
            try:
                version = subprocess.run([path, "--version"], capture_output=True, text=True,
                                         timeout=30).stdout.splitlines()[0]
            except (OSError, subprocess.SubprocessError, IndexError):
                continue
            return path, version
    return None


def _header_digest() -> str:
    digest = hashlib.sha256()
    for name in sorted(os.listdir(_CSRC)):
        with open(os.path.join(_CSRC, name), "rb") as fh:
            digest.update(name.encode() + fh.read())
    return digest.hexdigest()


def _folder(cache_dir: str) -> str:
    if cache_dir:
        return os.path.join(cache_dir, "kernels")
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "ort_dynamo", "kernels")


def library(source: str, cache_dir: str = "") -> str:
    """Path of the compiled library for ``source`` (compiled now if not on disk yet)."""
    compiler = _compiler()
    if compiler is None:
        raise KernelBuildError("no C compiler found (set CC, or install gcc)")
    key = hashlib.sha256("\n".join([source, _header_digest(), *compiler, *_FLAGS, *_LIBS]).encode()).hexdigest()
    folder = _folder(cache_dir)
    path = os.path.join(folder, f"pointwise_{key[:24]}.so")
    if os.path.exists(path):
        return path
    os.makedirs(folder, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as work:
        src = os.path.join(work, "kernels.c")
        with open(src, "w") as fh:
            fh.write(source)
        out = os.path.join(work, "kernels.so")
        result = subprocess.run([compiler[0], *_FLAGS, "-I", _CSRC, src, "-o", out, *_LIBS],
                                capture_output=True, text=True, timeout=600)
        if result.returncode != 0:
            raise KernelBuildError(f"{compiler[0]} failed on the generated kernels:\n{result.stderr[-2000:]}")
        os.replace(out, path)  # atomic: a concurrent process sees the whole file or none
    log.debug("compiled pointwise kernels into %s", path)
    return path


@functools.lru_cache(None)
def _builder() -> concurrent.futures.ThreadPoolExecutor:
    # The compiler runs as a child process: while it works, this process goes on exporting.
    return concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="ort_dynamo_kernels")


def build(source: str, cache_dir: str = "") -> concurrent.futures.Future:
    """``library(source, cache_dir)`` in the background: a future of the library's path."""
    return _builder().submit(library, source, cache_dir)


@functools.lru_cache(None)
def available() -> bool:
    """Whether kernels can be built and loaded here: a compiler, and a probe library that
    onnxruntime accepts. Checked once per process (the probe is cached on disk too)."""
    if _compiler() is None:
        log.info("no C compiler: elementwise chains run as ORT's separate kernels")
        return False
    try:
        import onnxruntime as ort

        from ._pointwise import kernel_source

        so = ort.SessionOptions()
        so.register_custom_ops_library(library(kernel_source([])))
        return True
    except Exception as exc:  # noqa: BLE001 - any failure means: do without
        log.warning("ort_dynamo: pointwise kernels unavailable, elementwise chains run unfused (%s)", exc)
        return False
