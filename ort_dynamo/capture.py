"""Capture: the Dynamo backend. AOTAutograd splits forward/backward; each graph walks
lower -> partition -> export -> rewrite -> run.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import math
import re
import warnings
from typing import Any, Mapping

import torch
import torch.fx
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.exc import exceptions_allowed_to_be_fallback

from . import _torch_attention
from . import cache as cache_stage
from . import export as export_stage
from . import inspectors
from . import lower as lower_stage
from . import partition as partition_stage
from . import rewrite as rewrite_stage
from . import run as run_stage
from .decompositions import size_hint
from .errors import ExportFailedError, OptionsError
from .options import FallbackPolicy, OrtOptions, resolve_options
from .report import FallbackNode, current_report

__all__ = ["OrtBackend", "ort_backend", "register_name_without_entry_point", "ExportFailedError"]

log = logging.getLogger("ort_dynamo")


class OrtBackend:
    """A ``torch.compile`` backend bound to one ``OrtOptions``.

    ``torch.compile(model, backend=OrtBackend(OrtOptions(opset=18)))``
    """

    def __init__(self, options: OrtOptions | Mapping[str, Any] | None = None) -> None:
        self.options = resolve_options(options)
        logging.getLogger("ort_dynamo").setLevel(self.options.log_level.to_logging())

    def __repr__(self) -> str:
        return f"OrtBackend({self.options})"

    def __call__(self, gm: torch.fx.GraphModule, example_inputs, **kwargs):
        if kwargs:
            raise OptionsError(f"OrtBackend takes its options at construction, got {sorted(kwargs)}")
        with collector_paused():
            try:
                return self._compile(gm, example_inputs)
            except _UNTRACEABLE as exc:
                return _graph_in_pytorch(gm, exc, self.options)

    def _compile(self, gm: torch.fx.GraphModule, example_inputs):
        options = self.options
        device = _device_type(example_inputs)
        cpu_flash = _cpu_flash(options, device)
        lower_stage.lower_graph(gm, fuse=options.enable_compute_optimizer and not options.deterministic_compute,
                                recompute_attention=options.memory_opt_level >= 1,
                                torch_attention=device == "cuda" and options.cuda_torch_attention,
                                cpu_flash=cpu_flash)
        compiler = functools.partial(compile_graph, options=self.options)
        kwargs = {}
        if self.options.memory_opt_level >= 1:
            kwargs["partition_fn"] = _recomputing_partition
        with lower_stage.whole_upsampling(), lower_stage.trainable_rnns(gm):
            return aot_autograd(
                fw_compiler=functools.partial(compiler, kind="forward"),
                bw_compiler=functools.partial(compiler, kind="backward"),
                inference_compiler=functools.partial(compiler, kind="inference"),
                decompositions=lower_stage.decomposition_table(
                    self.options.opset, self.options.cache_dir,
                    device == "cpu" and rewrite_stage.pointwise_kernels_apply(options, device), cpu_flash,
                    options.torch_random and device == "cpu",
                    own_products=rewrite_stage.own_products_apply(options, device)),
                **kwargs,
            )(gm, example_inputs)


#: What tracing with fake tensors raises for an op it cannot follow: a value read on the host
#: (``.item()``), an output shape that depends on the values, no fake kernel. Dynamo turns
#: these into a graph break that names neither the op nor the line.
_UNTRACEABLE = exceptions_allowed_to_be_fallback


def _graph_in_pytorch(gm: torch.fx.GraphModule, exc: Exception, options: OrtOptions):
    """The whole Dynamo graph runs in PyTorch (eagerly, as ``gm``), reported with the op and
    the line AOTAutograd could not trace; or, where the fallback policy forbids, an error."""
    op = str(getattr(exc, "func", "") or type(exc).__name__)
    found = re.search(r"While executing %(\w+)", str(exc))
    node = next((n for n in gm.graph.nodes if found and n.name == found.group(1)), None)
    fallback = FallbackNode("", node.name if node is not None else "",
                            _target_name(node) if node is not None else op,
                            f"AOTAutograd cannot trace it with fake tensors: it calls {op} ({type(exc).__name__}), "
                            f"so the whole graph runs in PyTorch",
                            partition_stage.user_source(node) if node is not None else "")
    partition_stage.refuse_or_warn([fallback], options.fallback_policy, "cannot be traced by AOTAutograd")
    graph_report = current_report().new_graph("dynamo")
    fallback.graph = graph_report.name
    calls = ("call_function", "call_method", "call_module")
    graph_report.torch_nodes = sum(1 for n in gm.graph.nodes if n.op in calls)
    graph_report.fallbacks.append(fallback)
    return gm


def _target_name(node: torch.fx.Node) -> str:
    """``bucketize`` for ``torch.bucketize``, the method's or submodule's name for the others."""
    return node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))


def _cpu_flash(options: OrtOptions, device: str) -> str:
    """Who runs flash attention for CPU inside ORT: "torch" (``cpu_torch_attention``, asked and
    possible here; else said once), "own" (``cpu_attention_kernel``: csrc/attention.h, where the
    kernels are built), or "" (attention written out). "own" also needs torch's library: the
    model that runs while the kernels compile calls torch's kernel in their place."""
    if device != "cpu":
        return ""
    problem = _torch_attention.problem()
    if options.cpu_torch_attention:
        if problem:
            partition_stage.warn_once(f"ort_dynamo: cpu_torch_attention: attention runs on ORT written out "
                                      f"instead: {problem}", cause=problem, stacklevel=3)
        return "" if problem else "torch"
    own = options.cpu_attention_kernel and not problem and rewrite_stage.pointwise_kernels_apply(options, device)
    return "own" if own else ""


def _device_type(example_inputs) -> str:
    """"cpu" unless a tensor input lives elsewhere (then that device's type)."""
    return next((t.device.type for t in example_inputs if isinstance(t, torch.Tensor) and t.device.type != "cpu"),
                "cpu")


def _recomputing_partition(joint_module, joint_inputs, **kwargs):
    """``memory_opt_level=1``: Inductor's min-cut rematerialization, allowed to recompute a
    value that a backward GEMM reads too. Inductor keeps those (the GEMM needs the value in
    memory, so recomputing costs a pass); for us that pass is part of a pointwise kernel, and
    the value need not live from forward to backward (BERT's GELU outputs: 16 MB).

    If the min-cut fails (it is a solver over torch internals), the graph gets the default
    partition, level 0's, with a warning and a line in the report: never a lost step."""
    from torch._functorch import config as functorch_config
    from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition

    _save_what_reads_a_mutated_input(joint_module.graph)
    # Our CSE where the graph mutates nothing: torch's imports Inductor's pattern matcher (for
    # its mutation regions), 0.6 s of a fresh process's first step. Elsewhere torch's runs.
    ours = functorch_config.cse and not any(_mutates(n) for n in joint_module.graph.nodes)
    if ours:
        joint_module.graph.eliminate_dead_code()
        joint_module.graph = _without_common_subexpressions(joint_module.graph)
    try:
        with functorch_config.patch(ban_recompute_materialized_backward=False, cse=functorch_config.cse and not ours):
            return min_cut_rematerialization_partition(joint_module, joint_inputs, **kwargs)
    except Exception as exc:  # noqa: BLE001 - an optimization: the graph still trains, keeping more
        reason = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
        current_report().recompute_failures.append(reason)
        warnings.warn(f"ort_dynamo: memory_opt_level=1 could not choose what to recompute in a graph, so it "
                      f"keeps every activation (level 0): {reason}. See ort_dynamo.report().", stacklevel=2)
        return default_partition(joint_module, joint_inputs, **kwargs)


def _save_what_reads_a_mutated_input(graph: torch.fx.Graph) -> None:
    """Values computed from an input the forward mutates (``self.steps.add_(1)``, then used)
    are saved, never recomputed: AOTAutograd writes the new value into the input after the
    forward, so backward would recompute from the mutated input. The min-cut does not know
    (it recomputed ``steps + 1`` from ``steps``, and backward failed autograd's version check).
    The joint graph's output descriptors name the mutated inputs; views of such an input are
    followed to what reads them."""
    from torch._functorch.partitioners import CheckpointPolicy
    from torch._functorch._aot_autograd.descriptors import InputMutationAOTOutput

    output = graph.find_nodes(op="output")[0]
    mutated = {desc.mutated_input for desc in output.meta.get("desc") or ()
               if isinstance(desc, InputMutationAOTOutput)}
    pending = [n for n in graph.find_nodes(op="placeholder") if n.meta.get("desc") in mutated]
    seen = set()
    while pending:
        node = pending.pop()
        if node in seen:
            continue
        seen.add(node)
        for user in node.users:
            if user.op != "call_function":
                continue
            if _is_view(user):
                pending.append(user)
            else:
                user.meta["recompute"] = CheckpointPolicy.MUST_SAVE


def _is_view(node: torch.fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return schema is not None and bool(schema.returns) and schema.returns[0].alias_info is not None \
        and not schema.returns[0].alias_info.is_write


def _mutates(node: torch.fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return node.op == "call_function" and schema is not None and schema.is_mutable


def _without_common_subexpressions(graph: torch.fx.Graph) -> torch.fx.Graph:
    """A copy of a graph without mutations in which a call with the same target and the same
    arguments as an earlier one is that one. Random ops, ``empty``, values that share storage
    with an output, and unbacked symbols stay as they are (as in torch's ``fx_graph_cse``)."""
    from torch._functorch.compile_utils import get_aten_target, rand_ops
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
    from torch.multiprocessing.reductions import StorageWeakRef

    def storage(node):
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor):
            return None
        try:
            return StorageWeakRef(value.untyped_storage())
        except NotImplementedError:
            return None

    output = graph.find_nodes(op="output")[0]
    returned = {storage(n) for n in output.all_input_nodes} - {None}
    new_graph, env, seen = torch.fx.Graph(), {}, {}
    for node in graph.nodes:
        value = node.meta.get("val")
        key = None
        if node.op == "call_function" and get_aten_target(node) not in rand_ops \
                and get_aten_target(node) is not torch.ops.aten.empty and storage(node) not in returned \
                and not (isinstance(value, torch.SymInt) and free_unbacked_symbols(value)):
            args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: env[n])
            key = (node.target, _hashable(args), _hashable(kwargs))
            try:
                if key in seen:
                    env[node] = seen[key]
                    continue
            except TypeError:  # an unhashable argument
                key = None
        env[node] = new_graph.node_copy(node, lambda n: env[n])
        if key is not None:
            seen[key] = env[node]
    return new_graph


def _hashable(value):
    """Containers as tuples, each leaf with its type (1, 1.0 and True are not the same
    argument); symbolic scalars as their FX node."""
    if isinstance(value, (list, tuple)):
        return (type(value), tuple(_hashable(v) for v in value))
    if isinstance(value, dict):
        return (dict, tuple((k, _hashable(v)) for k, v in value.items()))
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return (type(value), value.node)
    if isinstance(value, float):  # 0.0 == -0.0, but x + 0.0 and x + -0.0 differ at x = -0.0
        return (float, value, math.copysign(1.0, value))
    return (type(value), value)


@functools.lru_cache(maxsize=64)
def _backend_for(options: OrtOptions) -> OrtBackend:
    # Dynamo guards on the backend object: the same options must give the same object.
    return OrtBackend(options)


def register_name_without_entry_point() -> None:
    """``backend="ort"`` where no installed package declares it (this checkout on PYTHONPATH,
    not pip-installed): registered when ort_dynamo is imported. An installed entry point under
    that name, ours or another package's, is left as it is."""
    from importlib.metadata import entry_points

    from torch._dynamo.backends import registry

    if "ort" in registry._COMPILER_FNS or "ort" in entry_points(group="torch_dynamo_backends").names:
        return
    registry.register_backend(ort_backend, name="ort")


def ort_backend(gm: torch.fx.GraphModule, example_inputs, options=None):
    """The ``"ort"`` entry point: ``torch.compile(m, backend="ort", options={...})``."""
    return _backend_for(resolve_options(options))(gm, example_inputs)


@contextlib.contextmanager
def collector_paused():
    """Python's cyclic garbage collector off while a graph compiles (tracing, export and
    rewrite allocate hundreds of thousands of objects), and back on after, if it was on, with
    one collection of the youngest generation: the compile's own garbage (left to a later
    collection, it held BERT's training 4 MB higher), not a walk of the whole process. A cold
    first step paid two full collections (0.25-0.35 s each, BERT); it now pays one
    (docs/performance-log.md). Collections the application asks for (``gc.collect()``) still run;
    a collector the application turned off stays off."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
            gc.collect(0)


def compile_graph(gm: torch.fx.GraphModule, example_inputs, *, options: OrtOptions, kind: str):
    """Compile one AOTAutograd graph: returns a boxed callable. (A backward graph compiles at
    the first backward, outside ``OrtBackend.__call__``: hence its own pause of the collector.)"""
    with collector_paused():
        return _compile_graph(gm, example_inputs, options=options, kind=kind)


def _compile_graph(gm: torch.fx.GraphModule, example_inputs, *, options: OrtOptions, kind: str):
    graph_report = current_report().new_graph(kind)
    device = _device_type(example_inputs)
    lower_stage.unit_sums_removed(gm)
    lower_stage.stacked_row_gradients(gm)
    lower_stage.random_draws_in_pytorch(gm, all_draws=options.torch_random and device == "cpu" and kind != "backward")
    lower_stage.sizes_from_inputs(gm)
    lower_stage.squeezes_as_traced(gm)
    registry = functools.partial(export_stage.onnx_registry, options.opset)  # built on first need
    graph_key = cache_stage.cache_key(gm, options) if options.cache_dir else None
    known = cache_stage.load_json(options.cache_dir, graph_key, "verdicts") if graph_key else None
    watch = inspectors.watch_graph(gm, options, graph_report.name) if kind != "backward" else (lambda f: f)
    output_node = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    graph_report.outputs = len(output_node.args[0]) if isinstance(output_node.args[0], (tuple, list)) else 1
    with graph_report.stage("partition"):
        segments = _backward_segments(options, device, example_inputs) if kind == "backward" else 1
        kept = lower_stage.TORCH_ATTENTION if options.cuda_torch_attention else frozenset()
        parts = partition_stage.partition(gm, registry, options.fallback_policy, graph_report, known, segments,
                                          kept, bool(_cpu_flash(options, device)))
    if graph_key and known is None:
        cache_stage.store_json(options.cache_dir, graph_key, "verdicts", parts.verdicts)
    split = parts.module
    for name in parts.ort_submodules:
        sub = getattr(split, name)
        setattr(split, name, _compile_partition(sub, name, options, graph_report))
    split.graph.set_codegen(_ArgumentListCodeGen())
    split.recompile()
    log.info("compiled %s graph: %d node(s) on ORT, %d in PyTorch, %d partition(s)",
             graph_report.name, graph_report.ort_nodes, graph_report.torch_nodes,
             len(parts.ort_submodules))
    return watch(_boxed(split))


#: On CPU a backward gets one run per this many bytes of what it reads (saved activations and
#: weights), up to 8. A run costs host time and cuts the chains the pointwise kernels fuse
#: (an unrolled LSTM's cells: lstm_16's step 1.15x as long in 8 runs, benchmarks/layer_ops.py
#: --variant backward_segments=8); freeing a few MB early is not worth that, freeing a
#: transformer's 70-90 MB is (peak memory below eager's).
_SEGMENT_BYTES = 8 << 20
_MAX_CPU_SEGMENTS = 8


def _backward_segments(options: OrtOptions, device: str, example_inputs) -> int:
    """How many ORT runs a backward partition is cut into: the option, or by device and size. On
    CUDA one run: GPT-2's step is the host's there, and 8 runs held 2.2 GB more than one (H200)."""
    if options.backward_segments or device == "cuda":
        return options.backward_segments or 1
    read = sum(math.prod(size_hint(d) for d in t.shape) * t.element_size()
               for t in example_inputs if isinstance(t, torch.Tensor))
    return max(1, min(_MAX_CPU_SEGMENTS, read // _SEGMENT_BYTES))


class _ArgumentListCodeGen(torch.fx.graph.CodeGen):
    """The split graph takes AOTAutograd's argument list and empties it. FX code drops each
    local after its last use, so an input (a saved activation, in backward) is freed after
    the last partition that reads it, not when the whole graph returns."""

    def gen_fn_def(self, free_vars, maybe_return_annotation, **kwargs):
        names = [v.split(":")[0].split("=")[0].strip() for v in free_vars if v != "self"]
        head = f"def {getattr(self, '_func_name', 'forward')}(self, args_list){maybe_return_annotation}:"
        if names:
            head += f"\n    {', '.join(names)}, = args_list\n    args_list.clear()"
        return head


def _boxed(split: torch.fx.GraphModule):
    def run(args: list):
        return split(args)

    run._boxed_call = True
    return run


class _RunnerModule(torch.nn.Module):
    """Holds an OrtRunner where the split graph calls a submodule."""

    def __init__(self, runner) -> None:
        super().__init__()
        self.runner = runner

    def forward(self, *args):
        return self.runner(*args)


def _compile_partition(sub: torch.fx.GraphModule, name: str, options: OrtOptions,
                       graph_report) -> torch.nn.Module:
    """What the split graph calls for partition ``name``: its ORT runner, or its code in PyTorch."""
    stem = f"{graph_report.name}_{name}"
    # Counted before export, which adds casts to ``sub``: what the report counted as on ORT.
    nodes = sum(1 for n in sub.graph.nodes if partition_stage.is_compute(n))
    try:
        cached = key = None
        if options.cache_dir:
            key = cache_stage.cache_key(sub, options)
            cached = cache_stage.load(options.cache_dir, key)
        if cached is not None:
            exported, model_bytes = cached
            graph_report.cache_hits += 1
        else:
            with graph_report.stage("export"):
                exported = export_stage.export_graph(sub, options.opset)
            with graph_report.stage("rewrite"):
                model_bytes = rewrite_stage.rewrite(exported, options)
            graph_report.exports += 1
            if key is not None:
                cache_stage.store(options.cache_dir, key, exported, model_bytes)
    except Exception as exc:
        root = exc
        while root.__cause__ is not None:  # the exporter wraps a lowering's own message
            root = root.__cause__
        reason = f"export failed: {type(root).__name__}: {' '.join(str(root).split())[:300]}"
        if not (options.fallback_policy & FallbackPolicy.EXPORT_FAILURE):
            raise ExportFailedError(f"partition {stem} could not be exported to ONNX: {reason}") from exc
        warnings.warn(f"ort_dynamo: {stem} runs in PyTorch: {reason}", stacklevel=2)
        graph_report.partition_to_pytorch(name, reason, nodes)
        return run_stage.PartitionInPyTorch(sub)
    if options.save_onnx:
        path = export_stage.save_debug_files(exported, sub, model_bytes, options, stem)
        graph_report.onnx_paths.append(path)
    # The bytes are what runs. The IR (tens of thousands of Python objects per graph) would
    # live as long as the compiled graph and lengthen every full garbage collection.
    exported.model = None
    return _RunnerModule(run_stage.OrtRunner(exported, model_bytes, options, graph_report, sub, name, nodes))
