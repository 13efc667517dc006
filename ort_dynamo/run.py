"""Run: ORT sessions per partition and device, tensors handed over without copies.

Inputs are wrapped in place as OrtValues (``OrtValueVector.push_back_batch`` or DLPack);
ORT allocates outputs, which come back to PyTorch through DLPack. Nothing goes via numpy.
"""

from __future__ import annotations

import functools
import logging
import warnings
from typing import Callable, Sequence

import numpy as np
import onnxruntime as ort
import torch
from onnxruntime.capi import _pybind_state as C

from . import _cuda_allocator, _kernels, _torch_attention, _torch_blas
from .errors import OrtRuntimeError
from .export import ExportedGraph, _dense_permutation, _is_dense
from .options import FallbackPolicy, OrtOptions
from .partition import is_compute
from .report import GraphReport

__all__ = ["OrtRunner", "PartitionInPyTorch", "session_options", "providers_for", "torch_settings", "compute_stream",
           "run_options", "ort_device", "onnxruntime_problem", "MIN_ONNXRUNTIME",
           "OrtRuntimeError"]

log = logging.getLogger("ort_dynamo")

_NUMPY_DTYPES = {
    torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16,
    torch.int64: np.int64, torch.int32: np.int32, torch.int16: np.int16, torch.int8: np.int8,
    torch.uint8: np.uint8, torch.bool: np.bool_,
}
_ONNX_TYPES = {
    torch.float32: 1, torch.uint8: 2, torch.int8: 3, torch.int16: 5, torch.int32: 6, torch.int64: 7,
    torch.bool: 9, torch.float16: 10, torch.float64: 11, torch.bfloat16: 16,
}
_OPT_LEVELS = {
    "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}


def session_options(options: OrtOptions, device_type: str = "cpu", kernel_library: str = "",
                    device_index: int = 0, model: bytes = b"", torch_threads: bool = False) -> ort.SessionOptions:
    """``kernel_library``: a compiled ``_kernels`` library the model's custom ops come from;
    ``model``: the model, whose ops of torch's kernels (``_torch_attention``'s flash attention,
    ``_torch_blas``'s products) get their libraries; ``torch_threads``: the session runs on one
    thread, its heavy work on PyTorch's OpenMP threads (``_openmp``)."""
    so = ort.SessionOptions()
    if kernel_library:
        so.register_custom_ops_library(kernel_library)
    for torch_ops in (_torch_attention, _torch_blas):
        if torch_ops.DOMAIN.encode() in model:
            so.register_custom_ops_library(torch_ops.library(options.cache_dir))
    # Spinning ORT threads would starve PyTorch's own threads between our runs.
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.add_session_config_entry("session.inter_op.allow_spinning", "0")
    level = "disable" if options.deterministic_compute else options.graph_optimization_level
    so.graph_optimization_level = _OPT_LEVELS[level]
    if options.deterministic_compute:
        so.use_deterministic_compute = True
    if torch_threads:
        so.intra_op_num_threads = 1
    elif options.intra_op_num_threads:
        so.intra_op_num_threads = options.intra_op_num_threads
    so.log_severity_level = options.log_level.to_onnxruntime()
    if device_type == "cpu" or not options.cuda_memory_pattern:
        # A memory pattern pre-allocates each run's peak as one block; in the shared arena
        # these blocks fragment it (5-20 MB more per training process, no speed gained).
        so.enable_mem_pattern = False
    if options.shared_cpu_arena:
        _register_shared_cpu_arena()
    if device_type == "cuda":
        _cuda_allocator.register(device_index, options.cuda_allocator, options.cache_dir)
    # The environment's allocator where one is registered (ours, or the application's).
    so.add_session_config_entry("session.use_env_allocators", "1")
    return so


#: The shared arena's settings (OrtArenaCfg keys). One large first region instead of regions
#: doubling from 1 MB: its untouched pages cost no memory, and best-fit keeps reusing its low
#: addresses, where doubling regions spread a step's tensors over several (Llama: 212 against
#: 222 MB resident; ``benchmarks/memory_phases.py --arena`` compares settings).
_SHARED_ARENA_CONFIG = {"max_mem": 0, "arena_extend_strategy": 0, "initial_chunk_size_bytes": 256 << 20,
                        "max_dead_bytes_per_chunk": 64 << 10}


@functools.lru_cache(None)
def _register_shared_cpu_arena() -> None:
    """One CPU arena for all our sessions, registered once per process. Each session's own
    arena keeps its peak forever; forward and backward peak at different times, so sharing
    one lowers a training process's memory (docs/performance-log.md) at no measured speed cost.
    A registration replaces any earlier one for the same device, the application's included
    (hence ``shared_cpu_arena=False``)."""
    memory = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
    try:
        ort.create_and_register_allocator(memory, ort.OrtArenaCfg(_SHARED_ARENA_CONFIG))
    except Exception as exc:  # noqa: BLE001 - sessions then use their own arenas
        log.warning("ort_dynamo: shared CPU arena not registered, each session keeps its own (%s)", exc)


#: The oldest onnxruntime a session is made with: the release the test suite passes on. Older
#: ones failed it: before 1.25 the CPU kernels end the whole process (SIGFPE) on an integer
#: division by zero (1.22.0, 1.23.2, 1.24.1, 1.24.4); 1.25.0 averages a ceil-mode pooling window
#: larger than its input wrongly and has no float64 Cos.
MIN_ONNXRUNTIME = (1, 31)


def onnxruntime_problem(version: str = "") -> str:
    """Why onnxruntime ``version`` (the one imported, by default) cannot be used, or "" if it can."""
    version = version or ort.__version__
    found = tuple(int(part) for part in version.split(".")[:2] if part.isdigit())
    if found >= MIN_ONNXRUNTIME:
        return ""
    return (f"ort_dynamo needs onnxruntime >= {'.'.join(map(str, MIN_ONNXRUNTIME))}, this is {version}: "
            "older releases end the whole process on an integer division by zero (before 1.25) or "
            "compute some ops wrongly (1.25's average pooling), as ort_dynamo's tests found "
            "(pip install -U onnxruntime, or onnxruntime-gpu)")


def providers_for(device: torch.device, options: OrtOptions) -> list:
    """Execution providers for tensors on ``device``; CUDA needs onnxruntime-gpu. Refuses an
    onnxruntime older than ``MIN_ONNXRUNTIME``: every session is made with these."""
    problem = onnxruntime_problem()
    if problem:
        raise OrtRuntimeError(problem)
    available = ort.get_available_providers()
    wanted = {"cuda": "CUDAExecutionProvider", "cpu": "CPUExecutionProvider"}.get(device.type)
    if options.providers and wanted not in options.providers:
        raise OrtRuntimeError(f"tensors on {device} need {wanted}, but options.providers={options.providers}")
    if device.type == "cuda":
        if "CUDAExecutionProvider" not in available:
            raise OrtRuntimeError(
                "CUDA tensors need the CUDA execution provider, which this onnxruntime lacks "
                f"(providers: {available}). Install onnxruntime-gpu instead of onnxruntime "
                "(see docs/gpu.md).")
        cuda = {"has_user_compute_stream": "1", **dict(torch_settings(device))}
        if device.index:  # 0 is the provider's default; naming it makes ORT 1.31 warn per session
            cuda["device_id"] = str(device.index)
        return [("CUDAExecutionProvider", cuda), "CPUExecutionProvider"]
    if device.type != "cpu":
        raise OrtRuntimeError(f"tensors on {device} are not supported by ort_dynamo (CPU and CUDA only)")
    return ["CPUExecutionProvider"]


def torch_settings(device: torch.device) -> tuple[tuple[str, str], ...]:
    """The CUDA provider's options that follow PyTorch's state at the call: its current stream,
    whether float32 products may use TF32 (ORT's default is yes, PyTorch's no: left at ORT's,
    a transformer's gradients would differ from eager's by ~1e-3) and whether cuDNN benchmarks
    convolution algorithms (ORT's default is an exhaustive search for every new shape). A
    session keeps what it was made with, so sessions are kept per these. Empty on CPU."""
    if device.type != "cuda":
        return ()
    return (("user_compute_stream", str(compute_stream(device))),
            ("use_tf32", "1" if _tf32_matmuls() else "0"),
            ("cudnn_conv_algo_search", "EXHAUSTIVE" if torch.backends.cudnn.benchmark else "HEURISTIC"))


def _tf32_matmuls() -> bool:
    """Whether PyTorch lets CUDA float32 products use TF32, as its own matmuls decide: the
    matmul setting of the newer API, else its global one, else ``set_float32_matmul_precision``.
    (Reading ``allow_tf32`` raises once both APIs have been used.)"""
    for setting in (getattr(torch.backends.cuda.matmul, "fp32_precision", "none"),
                    getattr(torch.backends, "fp32_precision", "none")):
        if setting != "none":
            return setting == "tf32"
    return torch.get_float32_matmul_precision() != "highest"


#: cudaStreamLegacy: the CUDA runtime's and driver's handle for the legacy default stream, which
#: PyTorch's default stream is. PyTorch names that stream 0, but ORT takes 0 for "none given" and
#: runs on a non-blocking stream of its own, unordered with PyTorch's work (seen on an H200:
#: the host came back before the GPU was done, and PyTorch's stream was idle). Given 1, ORT runs
#: on PyTorch's default stream itself (benchmarks/host_ahead.py, "legacy stream handle", H100).
_LEGACY_STREAM = 1


def compute_stream(device: torch.device) -> int:
    """The CUDA stream ORT runs on (0 on CPU): PyTorch's current stream, its default one as
    ``_LEGACY_STREAM``. ORT's work and PyTorch's are then in one stream's order, with no event
    and no host wait between them. A CUDA session runs on the stream it was made with, so
    sessions are kept per stream: run on another, a session would read its inputs before
    PyTorch's work on that stream had written them."""
    if device.type != "cuda":
        return 0
    return torch.cuda.current_stream(device).cuda_stream or _LEGACY_STREAM


def run_options(device: torch.device) -> "C.RunOptions":
    """Options of every run on ``device``. ORT waits for the device at the end of each run
    unless told not to: on CUDA that would block the host once per partition, though ORT and
    PyTorch work on the same stream (``compute_stream``), in order, without waiting."""
    options = C.RunOptions()
    if device.type == "cuda":
        options.add_run_config_entry("disable_synchronize_execution_providers", "1")
    return options


def ort_device(device: torch.device) -> "C.OrtDevice":
    """ORT's name for ``device`` (where a bound tensor's memory is)."""
    if device.type == "cuda":
        return C.OrtDevice(C.OrtDevice.cuda(), C.OrtDevice.default_memory(), device.index or 0)
    return C.OrtDevice(C.OrtDevice.cpu(), C.OrtDevice.default_memory(), 0)


class OrtRunner:
    """Runs one exported partition; falls back to ``torch_fn`` where the policy allows."""

    def __init__(self, exported: ExportedGraph, model_bytes: bytes, options: OrtOptions,
                 graph_report: GraphReport, torch_fn: Callable, name: str, nodes: int | None = None) -> None:
        self.exported = exported
        self.model_bytes = model_bytes
        self.options = options
        self.report = graph_report
        self.torch_fn = torch_fn
        self.name = name
        #: Compute nodes the report counts on ORT for this partition (moved to PyTorch on failure).
        self.nodes = nodes if nodes is not None else sum(1 for n in torch_fn.graph.nodes if is_compute(n))
        self._sessions: dict[tuple, tuple] = {}  # by device and torch_settings
        self._failed: str | None = None
        self._in_pytorch: PartitionInPyTorch | None = None  # made at the first fallback
        #: Every input a tensor ORT takes as it is (``_inputs``'s short way).
        self._plain_inputs = (all(kind == "tensor" for kind in exported.input_kinds)
                              and not any(order is not None for order in exported.input_permutations or ()))
        #: The plain inputs' dtypes at the last run and their numpy types (one tuple: a thread
        #: sees both or neither): a run whose inputs have the same, checked in ``_inputs``' one
        #: pass, does not look them up again.
        self._types: tuple[tuple, list] = ((), [])
        #: The compiled library of ``exported.kernels``, if any: a future, built in the
        #: background. Until it is ready the model without the kernels runs (if there is
        #: one: ``exported.unfused``), so the compiler's time never holds up a step.
        self.kernel_library = None
        if exported.kernels:
            self.kernel_library = _kernels.build(exported.kernels, options.cache_dir, exported.torch_threads)
            graph_report.kernels += len(exported.kernels)

    # -- sessions ---------------------------------------------------------------------------------

    def _session(self, device: torch.device):
        key = (device, torch_settings(device))
        entry = self._sessions.get(key)
        if entry is not None and entry[-1] and self.kernel_library.done():
            entry = None  # the kernels are ready: the interim session makes way
        if entry is None:
            model, library, interim = self.model_bytes, "", False
            if self.kernel_library is not None:
                if self.kernel_library.done() or not self.exported.unfused:
                    model, library = self._with_kernels()
                else:
                    model, interim = self.exported.unfused, True
            with self.report.stage("session"):
                try:
                    sess = ort.InferenceSession(model, session_options(self.options, device.type, library,
                                                                       device.index or 0, model,
                                                                       self.exported.torch_threads),
                                                providers=providers_for(device, self.options))
                except Exception as exc:  # noqa: BLE001 - a library ORT refuses: run without it
                    if not library or not self.exported.unfused:
                        raise
                    model, library = self._without_kernels(exc), ""
                    sess = ort.InferenceSession(model, session_options(self.options, device.type, "",
                                                                       device.index or 0, model,
                                                                       self.exported.torch_threads),
                                                providers=providers_for(device, self.options))
            if library:
                # The kernels loaded: the model without them (MBs per partition) is done with.
                self.exported.unfused = b""
            if device.type == "cuda" and "CUDAExecutionProvider" not in sess.get_providers():
                raise OrtRuntimeError(f"CUDA EP was not enabled for {self.name}: {sess.get_providers()}")
            where = ort_device(device)
            entry = (sess, where, [where] * len(self.exported.output_names), run_options(device), interim)
            self._sessions[key] = entry
            self.report.sessions += 1
            self.report.providers.append(sess.get_providers()[0])
        return entry

    def _with_kernels(self) -> tuple[bytes, str]:
        """(model, library) once the kernels are built. If they cannot be, the model without
        them runs from then on (said once); without that model the error stands."""
        try:
            with self.report.stage("kernels"):
                return self.model_bytes, self.kernel_library.result()
        except _kernels.KernelBuildError as exc:
            if not self.exported.unfused:
                raise
            return self._without_kernels(exc), ""

    def _without_kernels(self, exc: Exception) -> bytes:
        """From now on the model without the kernels (said once); returns it."""
        warnings.warn(f"ort_dynamo: {self.report.name}/{self.name} runs without its pointwise kernels: "
                      f"{type(exc).__name__}: {str(exc)[:300]}", stacklevel=4)
        self.report.kernels -= len(self.exported.kernels)
        self.model_bytes, self.kernel_library = self.exported.unfused, None
        return self.model_bytes

    # -- running ----------------------------------------------------------------------------------

    def run_in_pytorch(self, *args):
        """The partition's FX code on ``args``, as its fallback runs it."""
        if self._in_pytorch is None:
            self._in_pytorch = PartitionInPyTorch(self.torch_fn)
        return self._in_pytorch(*args)

    def __call__(self, *args):
        if self._failed is not None:
            return self.run_in_pytorch(*args)
        try:
            return self._run(args)
        except OrtRuntimeError:
            raise
        except Exception as exc:
            _raise_if_out_of_memory(args, exc)
            if not (self.options.fallback_policy & FallbackPolicy.RUNTIME_FAILURE):
                raise OrtRuntimeError(f"ONNX Runtime failed on partition {self.name}: {exc}") from exc
            self._failed = f"{type(exc).__name__}: {exc}"
            warnings.warn(f"ort_dynamo: ONNX Runtime failed on {self.report.name}/{self.name}; "
                          f"running it in PyTorch from now on ({self._failed[:200]})", stacklevel=2)
            self.report.partition_to_pytorch(self.name, "runtime failure: " + self._failed[:300], self.nodes)
            return self.run_in_pytorch(*args)

    def _inputs(self, args: Sequence) -> tuple[Sequence, torch.device, list | None]:
        """The tensors ORT reads (contiguous, in the graph's layout, on one device), that device,
        and their numpy element types where the last run's still hold (else None)."""
        if self._plain_inputs and args:
            # The usual graph: tensors only, none permuted. One pass: this runs per partition
            # and step, and on CUDA the host's time is the step's (docs/performance-log.md).
            device = args[0].device
            index = device.index if device.type == "cuda" else -1
            dtypes, np_types = self._types
            if len(dtypes) == len(args) and all(t.get_device() == index and t.is_contiguous() and t.dtype is dtype
                                                for t, dtype in zip(args, dtypes)):
                return args, device, np_types
            if all(t.get_device() == index for t in args):
                dtypes = tuple(t.dtype for t in args)
                types = self._types = dtypes, [_NUMPY_DTYPES.get(dtype) for dtype in dtypes]
                return [t if t.is_contiguous() else t.contiguous() for t in args], device, types[1]
        exported = self.exported
        tensors = []
        device = None
        for index, (arg, kind) in enumerate(zip(args, exported.input_kinds)):
            if kind == "tensor":
                if device is None:
                    device = arg.device
                arg = exported.ort_layout(index, arg)
                tensors.append(arg if arg.is_contiguous() else arg.contiguous())
            else:
                tensors.append(arg)
        device = device or torch.device("cpu")
        # One session sees one device: a CPU scalar tensor in a CUDA graph moves (as eager
        # would promote it); wrapping its host pointer as device memory would be garbage.
        return [(t if t.device == device else t.to(device)) if isinstance(t, torch.Tensor)
                else _scalar_tensor(t, device) for t in tensors], device, None

    def _run(self, args: Sequence):
        exported = self.exported
        tensors, device, np_types = self._inputs(args)
        sess, where, out_devices, options, _ = self._session(device)
        inputs = C.OrtValueVector()
        inputs.reserve(len(tensors))
        if np_types is None:
            np_types = [_NUMPY_DTYPES.get(t.dtype) for t in tensors]
        pointers = [t.data_ptr() for t in tensors]
        if all(np_types) and all(pointers):
            inputs.push_back_batch(tensors, pointers, np_types, [t.shape for t in tensors],
                                   [where] * len(tensors))
        else:  # bfloat16 (no numpy type) or empty tensors (null data pointer)
            for t, pointer in zip(tensors, pointers):
                inputs.push_back(_wrap(t, pointer, where))
        outputs = C.OrtValueVector()
        sess._sess.run_with_ortvaluevector(options, exported.input_names, inputs, exported.output_names, outputs,
                                           out_devices)
        self.report.runs += 1
        results = outputs.to_dlpacks(torch._C._from_dlpack)
        for i, want in enumerate(exported.output_dtypes):
            got = results[i].dtype
            if got != want:
                # DLPack carries ORT's bool as uint8: same bytes, so a free view. Anything else
                # is a value conversion, never a reinterpretation of bits.
                results[i] = results[i].view(want) if (got, want) == (torch.uint8, torch.bool) \
                    else results[i].to(want)
        out = []
        for slot in exported.slots:
            if slot.kind == "ort":
                out.append(results[slot.index])
            elif slot.kind == "view":  # rewrite.py: a Reshape output ORT would have copied
                out.append(results[slot.index].view(slot.value))
            elif slot.kind == "permute":  # export.py: a permuted view, as eager has it
                out.append(results[slot.index].permute(slot.value))
            elif slot.kind == "input":
                out.append(args[slot.index])
            else:
                out.append(slot.value)
        return tuple(out) if exported.returns_tuple else out[0]


class PartitionInPyTorch(torch.nn.Module):
    """A partition's FX code run in PyTorch (its export or its ORT run failed), its tensor inputs
    first put in the memory layout they were traced with. The code's views are valid for that
    layout only, and a kernel kept in PyTorch before the partition can return other strides than
    its fake function said (PyTorch's fused CUDA attention: pytorch/pytorch#180445). ORT takes
    any layout, so only this path needs it."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        super().__init__()
        self.gm = gm
        self._orders: list | None = None  # per input: its traced dense layout, outermost dim first

    def forward(self, *args):
        if self._orders is None:
            self._orders = [_dense_order(n.meta.get("val")) for n in self.gm.graph.nodes if n.op == "placeholder"]
        return self.gm(*(_in_order(a, order) for a, order in zip(args, self._orders)))


def _dense_order(val) -> list[int] | None:
    """The dims of traced tensor ``val`` from outermost to innermost in memory, if it is dense;
    None otherwise (or for a tensor of fewer than 2 dims, whose layout views never depend on)."""
    if not isinstance(val, torch.Tensor) or val.dim() < 2:
        return None
    sizes = [getattr(getattr(x, "node", None), "hint", x) for x in val.shape]
    strides = [getattr(getattr(x, "node", None), "hint", x) for x in val.stride()]
    if not all(isinstance(x, int) for x in sizes + strides):
        return None  # no hint for a symbolic size: leave the input as it comes
    return _dense_permutation(sizes, strides)


def _in_order(arg, order: list[int] | None):
    if order is None or not isinstance(arg, torch.Tensor) or arg.dim() != len(order) \
            or _is_dense(arg.shape, arg.stride(), order):
        return arg
    return torch.empty_permuted(arg.shape, order, dtype=arg.dtype, device=arg.device).copy_(arg)


def _raise_if_out_of_memory(args: Sequence, exc: Exception) -> None:
    """A run that failed because PyTorch's allocator refused ORT memory is out of memory, as
    PyTorch would say it: never a reason to run the partition in PyTorch from then on."""
    device = next((a.device for a in args if isinstance(a, torch.Tensor) and a.device.type == "cuda"), None)
    refused = _cuda_allocator.refused_bytes(device.index or 0) if device is not None else 0
    if refused:
        raise torch.cuda.OutOfMemoryError(
            f"CUDA out of memory: PyTorch's allocator refused ONNX Runtime {refused / 2**20:.1f} MiB on {device} "
            f"(ORT: {str(exc)[:300]})") from exc


#: onnxruntime before 1.32: ``from_dlpack(capsule, is_bool_tensor)``, its DLPack import rejecting
#: kDLBool; from 1.32 one argument, bool included.
_DLPACK_BOOL_FLAG = "is_bool" in (C.OrtValue.from_dlpack.__doc__ or "")


def _wrap(t: torch.Tensor, pointer: int, where):
    if pointer:
        if not _DLPACK_BOOL_FLAG:
            return C.OrtValue.from_dlpack(t.detach().__dlpack__())
        # The same bytes as uint8, flagged bool
        is_bool = t.dtype == torch.bool
        return C.OrtValue.from_dlpack((t.view(torch.uint8) if is_bool else t).detach().__dlpack__(), is_bool)
    onnx_type = _ONNX_TYPES[t.dtype]
    return C.OrtValue.ortvalue_from_shape_and_onnx_type(list(t.shape), onnx_type, where)


def _scalar_tensor(value, device: torch.device) -> torch.Tensor:
    if isinstance(value, (bool, torch.SymBool)):
        return torch.tensor(bool(value), device=device)
    if isinstance(value, (int, torch.SymInt)):
        return torch.tensor(int(value), dtype=torch.int64, device=device)
    return torch.tensor(float(value), dtype=torch.float32, device=device)
