"""Options: one frozen, validated dataclass, overridable by ``ORT_DYNAMO_<NAME>`` variables.

Each field carries its documentation, its environment variable and its ORTModule
counterpart, so docs/options.md and the migration table are generated from here.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import os
from typing import Any, Mapping

from .errors import OptionsError

__all__ = ["FallbackPolicy", "LogLevel", "OrtOptions", "resolve_options"]

ENV_PREFIX = "ORT_DYNAMO_"


class FallbackPolicy(enum.Flag):
    """What may run in PyTorch instead of ONNX Runtime. ``DISABLE`` raises instead.

    Mirrors ORTModule's ``ORTMODULE_FALLBACK_POLICY``: flags combine with ``|``.
    """

    DISABLE = 0
    #: An op with no ONNX lowering stays in PyTorch (graph partitioning).
    UNSUPPORTED_OP = enum.auto()
    #: A partition whose ONNX export fails runs in PyTorch.
    EXPORT_FAILURE = enum.auto()
    #: A partition whose session creation or run fails runs in PyTorch from then on.
    RUNTIME_FAILURE = enum.auto()
    DEFAULT = UNSUPPORTED_OP | EXPORT_FAILURE | RUNTIME_FAILURE

    @classmethod
    def parse(cls, text: str) -> "FallbackPolicy":
        """Parse ``"UNSUPPORTED_OP|EXPORT_FAILURE"``; ORTModule's ``FALLBACK_`` prefix is accepted."""
        policy = cls.DISABLE
        for raw in text.replace(",", "|").split("|"):
            name = raw.strip().upper()
            if name.startswith("FALLBACK_"):
                name = name[len("FALLBACK_") :]
            name = _ORTMODULE_POLICY_ALIASES.get(name, name)
            if not name:
                continue
            if name not in cls.__members__:
                valid = ", ".join(cls.__members__)
                raise OptionsError(f"unknown fallback policy {raw.strip()!r}; valid: {valid}")
            policy |= cls[name]
        return policy


# ORTModule flag names that have a meaning here.
_ORTMODULE_POLICY_ALIASES = {
    "UNSUPPORTED_TORCH_MODEL": "UNSUPPORTED_OP",
    "UNSUPPORTED_ONNX_MODEL": "EXPORT_FAILURE",
    "BAD_INITIALIZATION": "RUNTIME_FAILURE",
    "FORCE_TORCH_RUN": "RUNTIME_FAILURE",
}


class LogLevel(str, enum.Enum):
    """ORTModule's log levels, mapped onto python ``logging``."""

    VERBOSE = "VERBOSE"
    INFO = "INFO"
    WARNING = "WARNING"
    ERROR = "ERROR"
    FATAL = "FATAL"

    def to_onnxruntime(self) -> int:
        """ORT's log severity (0 verbose .. 4 fatal), mapped as ORTModule mapped it: ORT's
        own warnings only from INFO down, so that WARNING stays quiet."""
        return {"VERBOSE": 0, "INFO": 2, "WARNING": 3, "ERROR": 3, "FATAL": 4}[self.value]

    def to_logging(self) -> int:
        return {
            "VERBOSE": logging.DEBUG,
            "INFO": logging.INFO,
            "WARNING": logging.WARNING,
            "ERROR": logging.ERROR,
            "FATAL": logging.CRITICAL,
        }[self.value]


_GRAPH_OPT_LEVELS = ("disable", "basic", "extended", "all")
_CUDA_ALLOCATORS = ("pytorch", "shared_arena", "per_session")
_CPU_MATMULS = ("auto", "ort", "torch_blas")
_CPU_THREAD_POOLS = ("auto", "torch", "ort")
_MIN_OPSET, _MAX_OPSET = 18, 23


def _field(default: Any, doc: str, ortmodule: str = "", **kw: Any) -> Any:
    return dataclasses.field(default=default, metadata={"doc": doc, "ortmodule": ortmodule, **kw})


@dataclasses.dataclass(frozen=True)
class OrtOptions:
    """Everything the ``ort`` backend can be told. Unknown keys raise ``ValueError``."""

    opset: int = _field(18, f"ONNX opset of exported graphs ({_MIN_OPSET}..{_MAX_OPSET}).",
                        "ORTMODULE_ONNX_OPSET_VERSION")
    fallback_policy: FallbackPolicy = _field(
        FallbackPolicy.DEFAULT,
        "What may fall back to PyTorch (see docs/fallback.md); `DISABLE` raises instead.",
        "ORTMODULE_FALLBACK_POLICY")
    log_level: LogLevel = _field(
        LogLevel.WARNING, "Level of the `ort_dynamo` python logger and of ONNX Runtime's session "
        "logs, as ORTModule's: VERBOSE shows ORT's node placements, INFO its warnings.",
        "ORTMODULE_LOG_LEVEL")
    save_onnx: bool = _field(False, "Write each exported ONNX model and its FX graph as text.",
                             "DebugOptions.save_onnx")
    onnx_prefix: str = _field("ort_dynamo", "File name prefix of saved models (a folder in it is created too).",
                              "DebugOptions.onnx_prefix")
    save_path: str = _field(".", "Folder for saved models (created if missing).",
                            "ORTMODULE_SAVE_ONNX_PATH")
    providers: tuple = _field(
        (), "Execution providers to use; empty = inferred from the tensors' device "
        "(CUDA EP for CUDA tensors, CPU EP otherwise).", "")
    graph_optimization_level: str = _field(
        "all", "ORT graph optimization level: " + ", ".join(_GRAPH_OPT_LEVELS) + ".", "")
    intra_op_num_threads: int = _field(0, "ORT intra-op threads; 0 = ORT's default.", "")
    enable_compute_optimizer: bool = _field(
        True, "Apply ort_dynamo's ONNX rewrites to ORT fused kernels; 0 for exact-parity debugging.",
        "ORTMODULE_ENABLE_COMPUTE_OPTIMIZER")
    deterministic_compute: bool = _field(
        False, "ORT `use_deterministic_compute`, rewrites and graph optimizations off.", "")
    print_input_density: bool = _field(False, "Print padding density of embedding/label inputs per step.",
                                       "ORTMODULE_PRINT_INPUT_DENSITY")
    print_memory_stats: bool = _field(False, "Print memory statistics per step.",
                                      "ORTMODULE_PRINT_MEMORY_STATS")
    memory_opt_level: int = _field(
        1, "1: recompute cheap ops in backward (min-cut rematerialization), those a backward GEMM "
        "reads included, and attention's probabilities from each row's logsumexp, as flash attention "
        "does; 0: keep every activation autograd saves (ORTModule's level 0, its default).",
        "ORTMODULE_MEMORY_OPT_LEVEL")
    backward_segments: int = _field(
        0, "Split each backward partition into up to this many ORT runs of at least 32 nodes each "
        "(a shorter run frees little and splits the chains pointwise kernels fuse), so each saved activation "
        "is freed once its last user has run (as eager's autograd frees it) instead of when the "
        "whole backward ends; 1 = one run. 0 = by device: on CPU one run per 8 MB the backward reads "
        "(saved activations, weights), up to 8, since a run costs host time and splits the chains "
        "pointwise kernels fuse; on CUDA 1, where each run costs host time the GPU waits for, and "
        "GPT-2 held more memory in 8 runs than in one (docs/performance-log.md, GPU).", "")
    pointwise_kernels: bool = _field(
        True, "On CPU, fuse chains of elementwise ops into C kernels generated and compiled (with the "
        "machine's C compiler, once, cached on disk) as an ORT custom-op library; without a compiler "
        "they run as ORT's separate kernels. On CUDA, the same chains as CUDA kernels compiled by NVRTC "
        "(which CUDA builds of torch install) for the GPU in use. Also hand-written kernels for single ops ORT's CPU "
        "provider runs slowly (max pooling with indices, depthwise convolutions and their gradients, "
        "slow transposes), and, where the CPU has AVX-512 (`python -m ort_dynamo info` says), float32 "
        "matrix products with a long inner dimension or few rows and one-group convolutions; with "
        "AVX512-BF16 also CPU autocast's bfloat16 products. FusedAdam's update too (there only the environment "
        "variable applies: optimizers take no options).", "")
    torch_random: bool = _field(
        True, "On CPU, random draws (dropout's masks, `rand`, `bernoulli`, ...) run in PyTorch with its "
        "generator, so `torch.manual_seed` and `torch.get_rng_state`/`set_rng_state` reproduce them, "
        "and dropout's masks are eager's own; listed in the report as kept in PyTorch by design. "
        "False: ORT draws them with a generator of its own, which nothing seeds (different every "
        "run). On CUDA ORT draws them either way.", "")
    cache_dir: str = _field(
        "", "Folder of an on-disk cache of exported models; empty = off. Entries are keyed by the "
        "graph, its inputs, the options and the package versions; a damaged entry is rebuilt, and "
        "a folder that cannot be read or written (read-only, full) only warns: compiling goes on "
        "without it.", "ORTMODULE_CACHE_DIR")
    cuda_torch_attention: bool = _field(
        True, "On CUDA, `scaled_dot_product_attention` stays in PyTorch's fused kernels (flash, "
        "memory-efficient or cuDNN attention) between ORT partitions, listed in the report as kept "
        "in PyTorch by design, not as fallbacks: stock ONNX Runtime has no attention backward, and "
        "its products and softmax written out were slower (docs/performance-log.md, GPU). False: "
        "attention runs on ORT written out, as on CPU.", "")
    cpu_torch_attention: bool = _field(
        False, "On CPU, float32 `scaled_dot_product_attention` without dropout runs PyTorch's flash "
        "attention for CPU (forward and backward) inside the ORT session, as a custom op that calls "
        "torch's kernel through its C shim, instead of as ORT's products and softmax; no graph split. "
        "Needs a C compiler (built once, like the kernels); without one, attention runs on ORT "
        "written out, with a warning. Off by default: on the 2-core CPU measured, steps were 0-7% "
        "slower with it, cold first steps 3-18% faster (docs/performance-log.md).", "")
    cpu_attention_kernel: bool = _field(
        True, "On CPU, float32 `scaled_dot_product_attention` without dropout and with a head size "
        "that is a multiple of 16 runs as one kernel of ort_dynamo's own each way (forward, "
        "backward: csrc/attention.h), which keeps a head's scores and probabilities in cache, "
        "instead of as ORT's batched products and softmax passes. Needs the pointwise kernels "
        "(a C compiler) and torch's C shim (until the kernels are built, the session runs "
        "torch's flash attention in their place); without them attention runs written out. "
        "`cpu_torch_attention` takes precedence.", "")
    cpu_matmul: str = _field(
        "auto", "Who multiplies matrices on CPU (float32 MatMul and Gemm, their folded transposes, a "
        "Gemm's bias, batches of products such as attention's written out; and CPU autocast's "
        "bfloat16 products). `torch_blas`: the BLAS eager's own "
        "products run on (MKL in PyTorch's x86 builds, its bfloat16 product on AMX where the CPU has "
        "it), called from inside the ORT session as a custom op (needs a C compiler, built once). "
        "`ort`: ORT's MLAS, and ort_dynamo's own products where they were faster "
        "(`pointwise_kernels`). `auto`: `torch_blas` when this torch uses MKL on an Intel CPU (on the "
        "Xeon measured: steps 6-14% faster in float32, 42-49% under autocast; docs/performance-log.md) "
        "or on a CPU without AVX-512 (on AMD Zen 3 MKL's products took 131 ms of BERT's step against "
        "MLAS's 141), else `ort` (on AMD Zen 4 MKL and MLAS were even, on Zen 5 MLAS twice as fast).", "")
    cpu_thread_pool: str = _field(
        "auto", "Whose threads run a CPU session's work. `torch`: the session runs on one thread and "
        "its heavy work, torch's BLAS products and ort_dynamo's kernels, splits over PyTorch's OpenMP "
        "threads, the ones eager's ops use; by default they spin a while after each op, so the next "
        "op finds them awake, where ORT's own threads sleep between runs and ops and must be woken "
        "(on a 2-core AMD Zen 3, the benchmark models' steps 7-12% faster). Needs GNU OpenMP in torch "
        "(its Linux builds), torch's BLAS (`cpu_matmul`) and the pointwise kernels; without them ORT's "
        "threads, with a warning. `ort`: ORT's intra-op threads (`intra_op_num_threads`). `auto`: "
        "`torch` where all of that holds, `intra_op_num_threads` is 0, OMP_WAIT_POLICY is not PASSIVE "
        "(then PyTorch's threads sleep too), and ORT's own ops that thread their work (convolutions, "
        "products left to MLAS) do at most a fifth of the graph's multiply-adds, and no RNN or other op "
        "of unknown work is left (a ViT's patch convolution is a few percent, a ResNet's are all); "
        "else `ort`.", "")
    cuda_memory_pattern: bool = _field(
        False, "On CUDA, ORT's memory pattern (`SessionOptions.enable_mem_pattern`): after a run, "
        "each later run of the same shapes allocates its intermediates as one block of the run's "
        "planned peak. Off (the default): each intermediate is allocated and freed on its own, from "
        "PyTorch's caching allocator by default, as eager's are. On an H200 (GPT-2 124M, bf16) the "
        "pattern held 1090 MB more at the step's peak (7246 against 6156 MB; eager 6930) for steps "
        "within 3% (docs/performance-log.md, GPU). On CPU the pattern is always off: its blocks fragment "
        "the shared arena.", "")
    shared_cpu_arena: bool = _field(
        True, "All CPU sessions of the process allocate from one ORT arena, registered by ort_dynamo "
        "(it replaces a CPU allocator the application registered with "
        "`onnxruntime.create_and_register_allocator`). False: sessions use the application's "
        "registered allocator if there is one, else each its own arena. The shared arena's first "
        "region is 256 MB of address space; its pages take memory only once used.", "")
    cuda_allocator: str = _field(
        "pytorch", "Where CUDA sessions get memory: `pytorch`: from PyTorch's caching allocator, one pool "
        "for both, as ORTModule had it (GPT-2 124M on an H100: 9.6 GB at its peak against eager's 6.9 GB; "
        "needs a C compiler for a small adapter, built once; without one, `shared_arena`, with a "
        "warning). `shared_arena`: one ORT arena per GPU for all sessions, beside PyTorch's pool; each "
        "keeps its own peak (12.0 GB there). `per_session`: each session its own ORT arena, kept at its "
        "peak for good (25.6 GB there). The first CUDA session's choice holds for the process: ORT keeps "
        "one allocator per GPU.",
        "")

    def __post_init__(self) -> None:
        _coerce_fields(self)
        if not (_MIN_OPSET <= self.opset <= _MAX_OPSET):
            raise OptionsError(f"opset must be in {_MIN_OPSET}..{_MAX_OPSET}, got {self.opset}")
        if self.graph_optimization_level not in _GRAPH_OPT_LEVELS:
            raise OptionsError(
                f"graph_optimization_level must be one of {_GRAPH_OPT_LEVELS}, "
                f"got {self.graph_optimization_level!r}")
        if self.cuda_allocator not in _CUDA_ALLOCATORS:
            raise OptionsError(f"cuda_allocator must be one of {_CUDA_ALLOCATORS}, got {self.cuda_allocator!r}")
        if self.cpu_matmul not in _CPU_MATMULS:
            raise OptionsError(f"cpu_matmul must be one of {_CPU_MATMULS}, got {self.cpu_matmul!r}")
        if self.intra_op_num_threads < 0:
            raise OptionsError(f"intra_op_num_threads must be >= 0, got {self.intra_op_num_threads}")
        if self.cpu_thread_pool not in _CPU_THREAD_POOLS:
            raise OptionsError(f"cpu_thread_pool must be one of {_CPU_THREAD_POOLS}, got {self.cpu_thread_pool!r}")
        if self.cpu_thread_pool == "torch" and self.cpu_matmul == "ort":
            raise OptionsError("cpu_thread_pool='torch' runs products on torch's BLAS, which "
                               "cpu_matmul='ort' rules out; set one of them otherwise")
        if self.cpu_thread_pool == "torch" and self.intra_op_num_threads > 1:
            raise OptionsError(f"cpu_thread_pool='torch' runs each session on one thread; "
                               f"intra_op_num_threads={self.intra_op_num_threads} asks for ORT's threads")
        if self.backward_segments < 0:
            raise OptionsError(f"backward_segments must be >= 0 (0: by device), got {self.backward_segments}")
        if self.memory_opt_level not in (0, 1):
            raise OptionsError(f"memory_opt_level must be 0 or 1, got {self.memory_opt_level}")
        known = {"CPUExecutionProvider", "CUDAExecutionProvider"}
        for provider in self.providers:
            if provider not in known:
                raise OptionsError(f"unsupported provider {provider!r}; valid: {sorted(known)}")
        if not self.onnx_prefix:
            raise OptionsError("onnx_prefix must not be empty")
        for name in ("cache_dir", "save_path"):
            folder = getattr(self, name)
            if folder and os.path.exists(folder) and not os.path.isdir(folder):
                raise OptionsError(f"{name}={folder!r} is a file, not a folder")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any] | None) -> "OrtOptions":
        mapping = dict(mapping or {})
        unknown = sorted(set(mapping) - set(cls.field_names()))
        if unknown:
            raise OptionsError(
                f"unknown ort_dynamo option(s) {unknown}; valid keys: {', '.join(cls.field_names())}")
        return cls(**mapping)

    def with_env(self, environ: Mapping[str, str] | None = None) -> "OrtOptions":
        """Return a copy where each set ``ORT_DYNAMO_<NAME>`` variable overrides its field."""
        environ = os.environ if environ is None else environ
        overrides: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            for var in env_names(f.name):
                if var in environ:
                    try:
                        overrides[f.name] = _parse_env(f.name, environ[var])
                    except ValueError as exc:
                        raise OptionsError(f"environment variable {var}: {exc}") from None
                    break
        return dataclasses.replace(self, **overrides) if overrides else self


def env_names(field_name: str) -> list[str]:
    """Variables that set a field, strongest first: ours, then the ORTModule name it migrates."""
    names = [ENV_PREFIX + field_name.upper()]
    ortmodule = OrtOptions.__dataclass_fields__[field_name].metadata["ortmodule"]
    if ortmodule.startswith("ORTMODULE_"):
        names.append(ortmodule)
    return names


def _parse_env(name: str, text: str) -> Any:
    kind = OrtOptions.__dataclass_fields__[name].type
    if kind == "bool":
        return _parse_bool(text)
    if kind == "int":
        try:
            return int(text)
        except ValueError:
            raise OptionsError(f"expected an integer, got {text!r}") from None
    if kind == "tuple":
        return tuple(p.strip() for p in text.split(",") if p.strip())
    return text


def _parse_bool(text: str | bool) -> bool:
    if isinstance(text, bool):
        return text
    lowered = str(text).strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise OptionsError(f"expected a boolean (1/0/true/false), got {text!r}")


def _coerce_fields(opts: OrtOptions) -> None:
    """Accept friendly spellings (strings for enums, lists for tuples); reject wrong types."""

    def put(name: str, value: Any) -> None:
        object.__setattr__(opts, name, value)

    if isinstance(opts.fallback_policy, str):
        put("fallback_policy", FallbackPolicy.parse(opts.fallback_policy))
    elif not isinstance(opts.fallback_policy, FallbackPolicy):
        raise OptionsError(f"fallback_policy must be a FallbackPolicy or str, got {opts.fallback_policy!r}")
    if not isinstance(opts.log_level, LogLevel):
        try:
            put("log_level", LogLevel(str(opts.log_level).upper()))
        except ValueError:
            raise OptionsError(
                f"log_level must be one of {[m.value for m in LogLevel]}, got {opts.log_level!r}") from None
    if isinstance(opts.providers, (list, str)):
        put("providers", tuple([opts.providers] if isinstance(opts.providers, str) else opts.providers))
    for f in dataclasses.fields(opts):
        value = getattr(opts, f.name)
        if f.type == "bool":
            try:
                put(f.name, _parse_bool(value))
            except OptionsError:
                raise OptionsError(f"{f.name} must be a boolean (1/0/true/false), got {value!r}") from None
        elif f.type == "int" and (not isinstance(value, int) or isinstance(value, bool)):
            raise OptionsError(f"{f.name} must be an int, got {value!r}")
        elif f.type == "str" and not isinstance(value, str):
            if isinstance(value, os.PathLike):
                put(f.name, os.fspath(value))
            else:
                raise OptionsError(f"{f.name} must be a str, got {value!r}")
        elif f.type == "tuple" and not isinstance(getattr(opts, f.name), tuple):
            raise OptionsError(f"{f.name} must be a tuple of str, got {value!r}")


def resolve_options(options: "OrtOptions | Mapping[str, Any] | None") -> OrtOptions:
    """Options as given (a mapping or an OrtOptions), then environment overrides."""
    if isinstance(options, OrtOptions):
        base = options
    elif options is None or isinstance(options, Mapping):
        base = OrtOptions.from_mapping(options)
    else:
        raise OptionsError(f"options must be a dict or OrtOptions, got {type(options).__name__}")
    return base.with_env()
