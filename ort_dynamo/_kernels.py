"""Kernels: generated C (``_pointwise``) -> an ONNX Runtime custom-op library.

Compiled with the machine's C compiler (``$CC``, else ``cc``/``gcc``/``clang``) for this CPU:
each kernel once, into an object file kept on disk under ``<cache_dir>/kernels`` (or the
user's cache folder, ``$XDG_CACHE_HOME/ort_dynamo/kernels``) by the hash of everything that
shapes it; a library links the objects a partition needs. Stock onnxruntime ships no C
headers; ``csrc/ort_abi.h`` declares the few parts of its stable C ABI the library uses.
"""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import json
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import weakref

from . import _nvrtc, _pointwise

__all__ = ["available", "bfloat16_products", "build", "built", "cuda_available", "describe", "describe_cuda",
           "float32_products", "host_library", "library", "wait", "KernelBuildError"]

log = logging.getLogger("ort_dynamo")

_CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
# No -ffast-math: results must match op-by-op float32 arithmetic. -fno-math-errno lets the
# vectorizer use libmvec's SIMD logf/tanhf/erff/powf (declared in pointwise.h).
# -fopenmp-simd: only the `omp simd` pragmas of row sums (vectorized partial sums); no OpenMP runtime.
# -fno-trapping-math: the kernels never read floating-point exception flags, and with them a
# select between a compare's outcomes (pw_expf's clamps) is not if-converted without AVX-512's
# masks: every loop with an exp stayed scalar on AVX2 CPUs (BERT's GELU backward 4x slower).
# Values are unchanged: it allows no reassociation, contraction or finite-math assumption.
_FLAGS = ["-O3", "-march=native", "-std=gnu11", "-fPIC", "-fno-math-errno", "-fno-trapping-math",
          "-ffp-contract=off", "-fopenmp-simd", "-fvisibility=hidden", "-w"]
# Where the CPU has AVX-512, loops are vectorized 512 bits wide: for Intel CPUs GCC and clang
# default to 256 (a tuning for older Xeons' clock drop), which ran every generated kernel's
# exp/erf at half speed (2x slower GELU backward on an Ice Lake Xeon; csrc's intrinsics kernels
# use 512-bit registers there anyway). The probe adds it when the target defines __AVX512F__.
_WIDE_VECTORS = ["-mprefer-vector-width=512"]


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


def _toolchain() -> tuple[str, str, tuple, tuple]:
    """(compiler, version, flags, libraries) to build kernels with."""
    compiler = _compiler()
    if compiler is None:
        raise KernelBuildError("no C compiler found (set CC, or install gcc)")
    return _probe(*compiler)


@functools.lru_cache(None)
def _probe(compiler: str, version: str) -> tuple[str, str, tuple, tuple]:
    """With glibc's libmvec when a library links against it here, else without (the kernels
    then call scalar log/tanh/erf). The answer is kept in the user's kernel folder, keyed by
    everything it depends on: a process pays the probe's compiler runs (50 ms of its first
    step) once per machine, not once per process."""
    key = hashlib.sha256("\n".join([_header_digest(), compiler, version, *_FLAGS, *_WIDE_VECTORS, _target(),
                                     " ".join(platform.libc_ver())]).encode()).hexdigest()[:24]
    answer = os.path.join(_folder(""), f"toolchain_{key}.json")
    try:
        with open(answer) as fh:
            extra, libs = json.load(fh)
        if all(isinstance(flag, str) for flag in [*extra, *libs]):
            return compiler, version, (*_FLAGS, *extra), tuple(libs)
    except (OSError, ValueError, TypeError):
        pass  # not probed here yet, or unreadable: probe
    wide = _WIDE_VECTORS if "__AVX512F__" in _macros(compiler, tuple(_FLAGS)) else []
    with tempfile.TemporaryDirectory() as work:
        src = os.path.join(work, "probe.c")
        with open(src, "w") as fh:
            fh.write('#include "pointwise.h"\nfloat probe(const float* x) { return logf(x[0]) + tanhf(x[1]); }\n')
        for extra, libs in ((wide, ["-lmvec", "-lm"]), ([*wide, "-DPW_NO_MVEC"], ["-lm"])):
            command = [compiler, *_FLAGS, *extra, "-shared", "-I", _CSRC, src, "-o", os.path.join(work, "p.so"), *libs]
            if subprocess.run(command, capture_output=True, timeout=120).returncode == 0:
                _keep_answer(answer, json.dumps([extra, libs]))
                return compiler, version, (*_FLAGS, *extra), tuple(libs)
    raise KernelBuildError(f"{compiler} cannot build a shared library here ({version})")


@functools.lru_cache(None)
def _macros(compiler: str, flags: tuple) -> str:
    """The predefined macros of ``compiler`` with ``flags`` (what -march=native targets); "" if it
    cannot say. One preprocessor run per process for the questions asked of it."""
    try:
        return subprocess.run([compiler, *flags, "-dM", "-E", "-x", "c", os.devnull], capture_output=True,
                              text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def _keep_answer(path: str, text: str) -> None:
    """Whole file or none; a folder that cannot be written only costs the next process a probe."""
    from .cache import write_atomically  # the cache's writer; imported late: the cache imports export

    try:
        write_atomically(path, text.encode())
    except OSError as exc:
        log.debug("could not keep the toolchain probe's answer in %s: %s", path, exc)


@functools.lru_cache(None)
def _target() -> str:
    """The CPU ``-march=native`` compiles for: its identity and instruction-set flags. A cache
    folder shared by machines (a home directory or cache_dir on a network drive) must not hand
    one CPU's objects to another, where they would die of an illegal instruction."""
    fields = ("vendor_id", "cpu family", "model", "model name", "flags",  # x86
              "CPU implementer", "CPU architecture", "CPU variant", "CPU part", "Features", "isa")
    try:
        with open("/proc/cpuinfo") as fh:
            first_cpu = fh.read(1 << 16).split("\n\n")[0]
        return "\n".join(" ".join(line.split()) for line in first_cpu.splitlines()
                         if line.split(":")[0].strip() in fields)
    except OSError:  # no procfs (macOS): what the platform says
        return " ".join([platform.machine(), platform.processor(), platform.platform()])


@functools.lru_cache(None)
def _runtime_source(openmp: bool = False) -> str:
    """The kernels' runtime; ``openmp``: its flavor whose tasks run on PyTorch's OpenMP threads
    (``_openmp``), for sessions that run on one thread."""
    with open(os.path.join(_CSRC, "pointwise_runtime.c")) as fh:
        return ("#define PW_OPENMP 1\n" if openmp else "") + fh.read()


@functools.lru_cache(None)
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


def _run(command: list[str], cwd: str) -> None:
    """One compiler run, at low priority: it gets the cores the training step leaves idle.
    (Spawned without a ``preexec_fn``, which would make Python fork the whole process, holding
    the interpreter for tens of milliseconds each time.)"""
    process = subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        os.setpriority(os.PRIO_PROCESS, process.pid, 10)
    except (OSError, AttributeError):
        pass
    output = process.communicate(timeout=600)[0]
    if process.returncode != 0:
        raise KernelBuildError(f"{command[0]} failed on the generated kernels:\n{output[-2000:]}")


def library(kernels: list[str], cache_dir: str = "", openmp: bool = False) -> str:
    """Path of the library of ``kernels`` (as ``_pointwise.fuse_pointwise`` emits them).
    Each kernel is compiled once into an object file kept on disk by its hash, so a kernel
    shared by several partitions, graphs or processes costs one compiler run; a library only
    links them. CUDA kernels make a library for ORT's CUDA provider (``_cuda_library``).
    ``openmp``: the CPU library whose kernels split their work over PyTorch's OpenMP threads
    (the same objects, another runtime: ``_runtime_source``)."""
    if kernels and all(_pointwise.is_cuda(k) for k in kernels):
        return _cuda_library(kernels, cache_dir)
    setup, table, folder, path = _library_path(kernels, cache_dir, openmp)
    if os.path.exists(path):
        return path
    try:
        return _build(kernels, setup, table, folder, path, openmp)
    except OSError as exc:  # read-only or full: the partition runs without kernels, and says why
        raise KernelBuildError(f"cannot write the kernels' files under {folder}: {exc}") from exc


def _build(kernels: list[str], setup: str, table: str, folder: str, path: str, openmp: bool = False) -> str:
    compiler, version, flags, libs = _toolchain()
    units = [_runtime_source(openmp), *kernels]
    if openmp:
        libs = (*libs, "-ldl")  # dlopen and dlsym: in libc only from glibc 2.34 on
    objects = [os.path.join(folder, "objects", hashlib.sha256((setup + unit).encode()).hexdigest()[:24] + ".o")
               for unit in units]
    os.makedirs(os.path.dirname(objects[0]), exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as work:
        # Every missing object in one compiler run (its driver runs one compiler per unit).
        missing = {obj: unit for unit, obj in zip(units, objects) if not os.path.exists(obj)}
        sources = []
        for index, unit in enumerate(missing.values()):
            sources.append(f"unit{index}.c")
            with open(os.path.join(work, sources[-1]), "w") as fh:
                fh.write(unit)
        if sources:
            _run([compiler, *flags, "-c", "-I", _CSRC, *sources], work)
        for source, obj in zip(sources, missing):
            os.replace(os.path.join(work, source[:-2] + ".o"), obj)  # atomic: whole object or none
        with open(os.path.join(work, "table.c"), "w") as fh:
            fh.write(table)
        # -z defs: a symbol no object defines fails here, not as a library ORT cannot load
        # (``-w`` keeps quiet about a call to an undeclared function).
        _run([compiler, *flags, "-shared", "-Wl,-z,defs", "-I", _CSRC, "-o", "kernels.so", *dict.fromkeys(objects),
              *libs, "table.c"], work)
        os.replace(os.path.join(work, "kernels.so"), path)
    log.debug("linked %d pointwise kernel(s) into %s", len(kernels), path)
    return path


def _library_path(kernels: list[str], cache_dir: str, openmp: bool = False) -> tuple[str, str, str, str]:
    """(toolchain digest, table source, folder, path) of the library of ``kernels``."""
    compiler, version, flags, libs = _toolchain()
    setup = "\n".join([_header_digest(), compiler, version, *flags, *libs, _target()])
    table = _pointwise.table_source(kernels)
    folder = _folder(cache_dir)
    key = hashlib.sha256("\n".join([setup, table, *(["openmp"] if openmp else [])]).encode()).hexdigest()
    return setup, table, folder, os.path.join(folder, f"pointwise_{key[:24]}.so")


# -- the GPU's ---------------------------------------------------------------------------------------

_HOST_FLAGS = ["-O2", "-std=gnu11", "-fPIC", "-fvisibility=hidden", "-w"]


@functools.lru_cache(None)
def _cuda_arch(device_index: int) -> str:
    import torch

    major, minor = torch.cuda.get_device_capability(device_index)
    return f"sm_{major}{minor}"


def _cuda_library_path(kernels: list[str], cache_dir: str, arch: str = "") -> tuple[str, str, str]:
    """(architecture, host table source, path) of the CUDA library of ``kernels`` for ``arch``
    (``"sm_90"``; default: the current device's)."""
    compiler = _compiler()
    if compiler is None:
        raise KernelBuildError("no C compiler found (set CC, or install gcc)")
    if not arch:
        import torch

        # The building thread's current device: device 0 in the background builder. A machine
        # mixing GPU generations would need a binary per device (not done: one cubin, one arch).
        arch = _cuda_arch(torch.cuda.current_device())
    table = _pointwise.cuda_table_source(kernels)
    key = hashlib.sha256("\n".join([_header_digest(), *compiler, *_HOST_FLAGS, arch, _nvrtc.version(), table,
                                    *kernels]).encode()).hexdigest()
    return arch, table, os.path.join(_folder(cache_dir), f"pointwise_cuda_{key[:24]}.so")


def _cuda_library(kernels: list[str], cache_dir: str, arch: str = "") -> str:
    """All of ``kernels`` compiled by NVRTC into one binary for this GPU (or ``arch``), embedded
    in a host library of ``csrc/pointwise_cuda_runtime.c`` that launches them; kept by the
    hash of all."""
    arch, table, path = _cuda_library_path(kernels, cache_dir, arch)
    if os.path.exists(path):
        return path
    with open(os.path.join(_CSRC, "pointwise_cuda.h")) as fh:
        header = fh.read()
    try:
        cubin = _nvrtc.compile_cuda('#include "pointwise_cuda.h"\n' + "\n".join(kernels), arch,
                                    {"pointwise_cuda.h": header})
    except _nvrtc.NvrtcError as exc:
        raise KernelBuildError(str(exc)) from exc
    image = f"{table}const unsigned char pw_cuda_image[] = {{{','.join(str(b) for b in cubin)}}};\n"
    host_library(path, ["-I", _CSRC, os.path.join(_CSRC, "pointwise_cuda_runtime.c"), "table.c", "-ldl", "-lpthread"],
                 {"table.c": image})
    log.debug("built %d CUDA pointwise kernel(s) for %s into %s", len(kernels), arch, path)
    return path


def built_host_library(stem: str, sources: list[str], cache_dir: str = "") -> str:
    """Path of a host library of ``sources`` (files of ``_CSRC``, whose includes are read from
    there too), built here unless an earlier process left it: kept on disk by the hash of
    that folder's files, the compiler and its flags."""
    compiler = _compiler()
    if compiler is None:
        raise KernelBuildError("no C compiler found (set CC, or install gcc)")
    parts = [*compiler, *_HOST_FLAGS, *map(os.path.basename, sources), _header_digest()]
    key = hashlib.sha256("\n".join(parts).encode())
    path = os.path.join(_folder(cache_dir), f"{stem}_{key.hexdigest()[:24]}.so")
    if not os.path.exists(path):
        host_library(path, ["-I", _CSRC, *sources])
    return path


@functools.lru_cache(None)
def torch_library(name: str) -> "ctypes.CDLL":
    """One of torch's own libraries (``libtorch_cpu.so``, ``libtorch_cuda.so``), loaded: its C
    shim's functions are looked up there (torch does not load its libraries globally)."""
    import ctypes

    import torch

    return ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", name))


def torch_shim_problem(library: str, functions: tuple[str, ...], what: str) -> str:
    """Why ``functions`` of torch's ``library`` cannot be called from a host library here (no
    compiler, or a torch without them), or "" if they can; ``what`` names the use."""
    if _compiler() is None:
        return f"no C compiler for {what} (install gcc, or set CC)"
    try:
        shim = torch_library(library)
        for name in functions:
            getattr(shim, name)
    except (OSError, AttributeError) as exc:
        return f"this torch's {library} lacks the C shim functions of {what} ({exc})"
    return ""


def host_library(path: str, arguments: list[str], files: dict[str, str] | None = None) -> None:
    """Make the shared library ``path`` with the C compiler (``_HOST_FLAGS``) from ``arguments``,
    in a scratch folder beside it where ``files`` (name: text) are written first: the whole
    library lands or none, and a folder that cannot be written is a ``KernelBuildError``."""
    folder = os.path.dirname(path)
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder) as work:
            for name, text in (files or {}).items():
                with open(os.path.join(work, name), "w") as fh:
                    fh.write(text)
            _run([_compiler()[0], *_HOST_FLAGS, "-shared", "-o", "library.so", *arguments], work)
            os.replace(os.path.join(work, "library.so"), path)
    except OSError as exc:
        raise KernelBuildError(f"cannot write the kernels' files under {folder}: {exc}") from exc


@functools.lru_cache(None)
def cuda_available() -> bool:
    """Whether CUDA kernels can be built here: a C compiler for the host library, and an NVRTC
    that compiles for the current GPU (probed once per process with an empty kernel, so that a
    broken one costs one warning, not one per partition)."""
    if _compiler() is None or not _nvrtc.available():
        log.info("no %s: elementwise chains on the GPU run as ORT's separate kernels",
                 "C compiler" if _compiler() is None else "NVRTC")
        return False
    try:
        import torch

        _nvrtc.compile_cuda('extern "C" __global__ void probe() {}', _cuda_arch(torch.cuda.current_device()), {})
    except Exception as exc:  # noqa: BLE001 - any failure means: do without
        log.warning("ort_dynamo: CUDA pointwise kernels unavailable, elementwise chains run unfused (%s)", exc)
        return False
    return True


def built(kernels: list[str], cache_dir: str = "", openmp: bool = False) -> str | None:
    """The library of ``kernels`` if an earlier build left it on disk, else None (no build)."""
    if kernels and all(_pointwise.is_cuda(k) for k in kernels):
        path = _cuda_library_path(kernels, cache_dir)[2]
        return path if os.path.exists(path) else None
    path = _library_path(kernels, cache_dir, openmp)[3]
    return path if os.path.exists(path) else None


@functools.lru_cache(None)
def _builder() -> concurrent.futures.ThreadPoolExecutor:
    # The compiler runs as child processes (``_run``): while they work, this process goes on
    # exporting. One library at a time, so they never take the exporting core too.
    return concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ort_dynamo_kernels")


# A forked child (DDP workers started by fork) has none of its parent's threads: a new pool.
os.register_at_fork(after_in_child=_builder.cache_clear)


def build(kernels: list[str], cache_dir: str = "", openmp: bool = False) -> concurrent.futures.Future:
    """``library(kernels, cache_dir, openmp)`` in the background: a future of the library's path."""
    future = _builder().submit(library, kernels, cache_dir, openmp)
    _building.add(future)
    return future


_building: "weakref.WeakSet[concurrent.futures.Future]" = weakref.WeakSet()


def wait() -> None:
    """Until every library being built is done (built or failed): after this, every compiled
    partition runs with its kernels, or knows it cannot."""
    for future in list(_building):
        concurrent.futures.wait([future])


def describe() -> str:
    """One line for ``python -m ort_dynamo info``: whether kernels build here, and with what."""
    if not available():
        return "no: " + ("no C compiler (install gcc, or set CC)" if _compiler() is None
                         else "the compiler or onnxruntime refused a probe library (see the log)")
    compiler, version, flags, libs = _toolchain()
    products = ("bfloat16 and float32 products" if bfloat16_products()
                else "float32 products (no AVX512-BF16 here for bfloat16 ones)" if float32_products()
                else "no products of its own (no AVX-512 here)")
    return f"yes ({version}; {'with' if '-lmvec' in libs else 'without'} libmvec; {products})"


def describe_cuda() -> str:
    """One line for ``python -m ort_dynamo info``: whether GPU kernels build here."""
    if _compiler() is None:
        return "no: no C compiler for their host library (install gcc, or set CC)"
    if not _nvrtc.available():
        return "no: no NVRTC (CUDA builds of torch install it: the nvidia-cuda-nvrtc wheel)"
    return f"yes (NVRTC {_nvrtc.version()}; built for the GPU in use)"


@functools.lru_cache(None)
def float32_products() -> bool:
    """Whether the kernels' compiler targets AVX-512 (F, BW, VL, DQ) here: the float32 products
    and convolutions of csrc/bf16_gemm.h, conv.h and conv_weight_grad.h."""
    try:
        compiler, _, flags, _ = _toolchain()
    except KernelBuildError:
        return False
    macros = _macros(compiler, flags)
    return all(f"__AVX512{part}__" in macros for part in ("F", "BW", "VL", "DQ"))


@functools.lru_cache(None)
def bfloat16_products() -> bool:
    """Whether the kernels' compiler targets AVX512-BF16 here (the instruction of CPU autocast's
    products, csrc/bf16_gemm.h): asked of its preprocessor with the kernels' flags."""
    try:
        compiler, _, flags, _ = _toolchain()
    except KernelBuildError:
        return False
    return float32_products() and "__AVX512BF16__" in _macros(compiler, flags)


@functools.lru_cache(None)
def available() -> bool:
    """Whether kernels can be built and loaded here: a compiler, and a probe library that
    onnxruntime accepts. Checked once per process (the probe's answer and the empty library
    are kept on disk)."""
    if _compiler() is None:
        log.info("no C compiler: elementwise chains run as ORT's separate kernels")
        return False
    try:
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.register_custom_ops_library(library([]))
        return True
    except Exception as exc:  # noqa: BLE001 - any failure means: do without
        log.warning("ort_dynamo: pointwise kernels unavailable, elementwise chains run unfused (%s)", exc)
        return False
