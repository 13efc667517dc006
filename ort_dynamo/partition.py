"""Partition: nodes with an ONNX lowering go to ORT, the rest stay in PyTorch."""

from __future__ import annotations

import dataclasses
import operator
import re
from typing import Callable
import warnings

import torch
import torch.fx
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner, Partition
from torch.fx.passes.tools_common import stable_topological_sort
from torch.fx.passes.operator_support import OperatorSupportBase

from .errors import UnsupportedOpError
from .lower import FLASH_FOR_CPU, IN_PYTORCH, TORCHLIB_FAKE_LOGSUMEXP, TORCHLIB_WRONG
from .lowerings import dtype_refusal
from .options import FallbackPolicy
from .report import FallbackNode, GraphReport

__all__ = ["partition", "refuse_or_warn", "UnsupportedOpError", "Partitioned"]

#: (op, reason) pairs already warned about in this process; reset() clears it.
_WARNED: set = set()


@dataclasses.dataclass
class Partitioned:
    module: torch.fx.GraphModule
    ort_submodules: list[str]
    #: node name -> "" (runs on ORT) or why not, for every node torchlib was asked about.
    verdicts: dict[str, str]


def user_source(node: torch.fx.Node) -> str:
    """The user's line that produced ``node``: the last frame of its stack trace."""
    trace = node.meta.get("stack_trace") or ""
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)', trace)
    if not frames:
        return ""
    path, line, func, code = frames[-1]
    return f"{path}:{line} in {func}: {code.strip()}"


def _is_tensor_value(val) -> bool:
    if isinstance(val, torch.Tensor):
        return True
    return isinstance(val, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in val) and all(
        v is None or isinstance(v, torch.Tensor) for v in val)


def is_compute(node: torch.fx.Node) -> bool:
    """A node that computes tensors (shape arithmetic on SymInts and getitem are not)."""
    if _is_linalg_error_check(node):
        return False
    return (node.op == "call_function" and node.target is not operator.getitem
            and _is_tensor_value(node.meta.get("val")))


def _is_linalg_error_check(node: torch.fx.Node) -> bool:
    """linalg ops' host-side check of ``info`` (eager's LinAlgError), threaded through an
    effect token: it raises or does nothing, so it stays in PyTorch and is no fallback."""
    return (node.op == "call_function" and node.target is torch.ops.higher_order.with_effects
            and len(node.args) > 1 and node.args[1] is torch.ops.aten._linalg_check_errors.default)


_aten = torch.ops.aten
#: Views that read all of their input: moved to a later backward segment, such a view has its
#: base cross instead, no more memory (not slices, which may read part of a larger base).
_WHOLE_INPUT_VIEWS = frozenset({
    _aten.view.default, _aten._unsafe_view.default, _aten.expand.default, _aten.unsqueeze.default,
    _aten.squeeze.dim, _aten.squeeze.dims, _aten.permute.default, _aten.t.default, _aten.transpose.int,
    _aten.alias.default})
#: Ops whose result shares its input's memory.
_VIEW_OPS = _WHOLE_INPUT_VIEWS | {
    _aten.reshape.default, _aten.detach.default, _aten.squeeze.default, _aten.slice.Tensor, _aten.select.int,
    _aten.as_strided.default, _aten.diagonal.default}


def _split_off_output_views(gm: torch.fx.GraphModule) -> set[torch.fx.Node]:
    """The chains of view ops that make graph outputs, as nodes of their own. ORT would return
    each as a copy; PyTorch takes them as free views of the tensor ORT returns anyway, as
    eager does. Saved activations are often such views (a transposed weight is a view of the
    parameter), so this keeps their memory at eager's. A chain that also feeds other nodes is
    duplicated for the output: ORT computes the original for its own users.

    Only chains over a tensor eager lays out contiguously: ORT's outputs are contiguous, and
    AOTAutograd traced the views against eager's strides (an elementwise op on a transposed
    tensor keeps its layout, so ``add.transpose(1, 2).view(...)`` is valid in eager and not
    on ORT's result; an ``as_strided`` would read the wrong elements)."""
    graph = gm.graph
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    views: set[torch.fx.Node] = set()
    copies: dict[torch.fx.Node, torch.fx.Node] = {}

    def is_view(node) -> bool:
        return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in _VIEW_OPS

    def output_view(node: torch.fx.Node) -> torch.fx.Node:
        if node in copies:
            return copies[node]
        source = node.args[0]
        if is_view(source):
            source = output_view(source)
        with graph.inserting_before(output):
            copy = graph.node_copy(node, lambda n: source if n is node.args[0] else n)
        copies[node] = copy
        views.add(copy)
        return copy

    def over_contiguous(node: torch.fx.Node) -> bool:
        root = node
        while is_view(root) and isinstance(root.args[0], torch.fx.Node):
            root = root.args[0]
        if root.op == "placeholder":
            return True  # a view of the caller's own tensor, whatever its layout
        value = root.meta.get("val")
        return isinstance(value, torch.Tensor) and value.is_contiguous()

    def replace(arg):
        return output_view(arg) if is_view(arg) and over_contiguous(arg) else arg

    output.args = (torch.fx.node.map_aggregate(output.args[0], replace),)
    for node in reversed(list(copies)):  # originals that only made outputs are dead now
        if not node.users:
            graph.erase_node(node)
    return views  # no recompile: fusing the partitions recompiles ``gm``


class _OnnxSupport(OperatorSupportBase):
    def __init__(self, registry: Callable, known: dict[str, str] | None,
                 by_design: set[torch.fx.Node] = frozenset(), cpu_flash: bool = False) -> None:
        from torch.onnx._internal.exporter import _dispatching

        self._dispatch = _dispatching.dispatch
        self._registry = registry  # called only when a node needs torchlib's verdict
        self._known = known or {}  # verdicts of an identical graph, from the on-disk cache
        self.verdicts: dict[torch.fx.Node, str] = {}  # node -> "" if supported, else the reason
        self.by_design = by_design  # taken in PyTorch by design, not fallbacks
        #: Flash attention for CPU left whole by the decompositions runs in ORT (a custom op).
        self.cpu_flash = cpu_flash

    def reason(self, node: torch.fx.Node) -> str:
        if node in self.verdicts:
            return self.verdicts[node]
        if node.target is operator.getitem:
            source = node.args[0]
            verdict = self.reason(source) if isinstance(source, torch.fx.Node) else "not a tensor"
        elif node in self.by_design:
            verdict = "kept in PyTorch by design"
        elif not is_compute(node):
            verdict = "not a tensor computation"
        elif not isinstance(node.target, torch._ops.OpOverload):
            verdict = f"{node.target} is not an ATen op"
        elif node.target in TORCHLIB_WRONG and not (self.cpu_flash and node.target in FLASH_FOR_CPU):
            verdict = "torchlib's lowering of this op is wrong for training"
        elif node.target in TORCHLIB_FAKE_LOGSUMEXP:
            verdict = "torchlib's lowering returns a logsumexp of zeros, which this op's backward reads"
        elif node.target in _ACCUMULATING_INDEX_PUT and _accumulates(node):
            # Those through adjacent index tensors became scatter_add (decompositions.py).
            verdict = ("ORT's ScatterND(reduction=add) sums repeated indices from racing threads "
                       "(wrong results)")
        elif any(isinstance(t, torch.Tensor) and (t.is_complex() or t.is_sparse or t.is_quantized)
                 for t in (*_tensor_args(node), *_tensor_outputs(node))):
            verdict = "complex, sparse or quantized tensors are not supported by ORT"
        elif refusal := dtype_refusal(node):
            verdict = refusal
        elif missing := _no_float64_kernel_on_cpu(node):
            verdict = f"ORT's CPU provider has no float64 {missing} kernel (float32 would lose eager's digits)"
        elif symbolic := _symbolic_attributes(node):
            verdict = (f"its {symbolic} symbolic, and ONNX takes it as an attribute (under dynamic=True, "
                       f"Dynamo makes an int the function closes over symbolic; a module's are constants)")
        elif node.name in self._known:
            verdict = self._known[node.name]
        else:
            try:
                function, message = self._dispatch(node, self._registry())
            except Exception as exc:  # the dispatcher can trip on odd metadata
                function, message = None, f"{type(exc).__name__}: {exc}"
            verdict = "" if function is not None else f"no ONNX lowering ({_short(message)})"
        self.verdicts[node] = verdict
        return verdict

    def is_node_supported(self, submodules, node: torch.fx.Node) -> bool:
        return node.op == "call_function" and node not in self.by_design and self.reason(node) == ""


_ACCUMULATING_INDEX_PUT = {_aten.index_put.default, _aten._unsafe_index_put.default}

#: ATen ops whose lowering's ONNX op ORT's CPU provider runs in float32 but not in float64
#: (probed on onnxruntime 1.31 with OpInfo's float64 samples: "Could not find an implementation
#: for Erf(13)"). Found at run time, the whole partition moved to PyTorch; refused here, only the op.
_NO_FLOAT64_ON_CPU = {getattr(_aten, name).default: onnx for name, onnx in (
    ("erf", "Erf"), ("erfc", "Erf"), ("special_ndtr", "Erf"), ("sinh", "Sinh"), ("cosh", "Cosh"),
    ("tan", "Tan"), ("asin", "Asin"), ("acos", "Acos"), ("atan", "Atan"), ("asinh", "Asinh"),
    ("acosh", "Acosh"), ("atanh", "Atanh"), ("atan2", "Atan"), ("convolution", "Conv"),
    ("avg_pool1d", "AveragePool"), ("avg_pool2d", "AveragePool"), ("avg_pool3d", "AveragePool"))
    if hasattr(_aten, name)}


def _no_float64_kernel_on_cpu(node: torch.fx.Node) -> str:
    """The ONNX op ORT's CPU provider lacks a float64 kernel for, if ``node`` needs it ("")."""
    missing = _NO_FLOAT64_ON_CPU.get(node.target)
    if missing is None and node.target is _aten.gelu.default and node.kwargs.get("approximate", "none") == "none":
        missing = "Erf"
    if missing is None:
        return ""
    on_cpu_in_float64 = any(t.dtype == torch.float64 and t.device.type == "cpu" for t in _tensor_args(node))
    return missing if on_cpu_in_float64 else ""


#: Arguments that ONNX takes as attributes (numbers fixed in the graph), by position.
_ATTRIBUTE_ARGUMENTS = {_aten.convolution.default: {3: "stride", 4: "padding", 5: "dilation", 7: "output_padding",
                                                    8: "groups"}}


def _symbolic_attributes(node: torch.fx.Node) -> str:
    """Which of the node's attribute arguments is symbolic ("stride is"), or ""."""
    from torch.fx.experimental.symbolic_shapes import is_concrete_int

    for position, name in _ATTRIBUTE_ARGUMENTS.get(node.target, {}).items():
        value = node.args[position] if position < len(node.args) else None
        values = [v.meta.get("val") if isinstance(v, torch.fx.Node) else v
                  for v in (value if isinstance(value, (list, tuple)) else [value])]
        if any(isinstance(v, torch.SymInt) and not is_concrete_int(v) for v in values):
            return f"{name} is"
    return ""


def _accumulates(node: torch.fx.Node) -> bool:
    return bool(node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False))


def _tensor_args(node: torch.fx.Node):
    for arg in node.all_input_nodes:
        val = arg.meta.get("val")
        if isinstance(val, torch.Tensor):
            yield val


def _tensor_outputs(node: torch.fx.Node):
    val = node.meta.get("val")
    yield from (val if isinstance(val, (tuple, list)) else (val,))


def _short(message: str) -> str:
    message = " ".join(str(message).split())
    return message if len(message) <= 160 else message[:157] + "..."


def partition(gm: torch.fx.GraphModule, registry: Callable, policy: FallbackPolicy,
              graph_report: GraphReport, known: dict[str, str] | None = None,
              segments: int = 1, kept: frozenset = frozenset(), cpu_flash: bool = False) -> Partitioned:
    """Split ``gm`` into ORT-bound submodules (``fused_N``) and PyTorch nodes.

    ``registry`` is called (once) only if a node needs torchlib's verdict: ``known`` verdicts
    of an identical graph, from the on-disk cache, spare building it.
    Records each node left in PyTorch, with its reason and source line, in ``graph_report``.
    Raises ``UnsupportedOpError`` if that is not allowed by ``policy``.
    Each ORT partition is cut into up to ``segments`` consecutive runs (see ``_in_segments``).
    Nodes of the ``kept`` ops, and those ``lower`` marked ``IN_PYTORCH`` (random draws), stay in
    PyTorch by design: reported as such, never refused by ``policy``. ``cpu_flash``: flash
    attention for CPU, where the decompositions left it, runs in ORT (a custom op: torch's kernel
    or ort_dynamo's).
    """
    host_views = _split_off_output_views(gm)
    by_design = {node for node in gm.graph.nodes if node.target in kept or IN_PYTORCH in node.meta}
    in_pytorch = host_views | by_design
    support = _OnnxSupport(registry, known, in_pytorch, cpu_flash)
    unsupported = []
    for node in gm.graph.nodes:
        kept_reason = _KEPT_REASON if node.target in kept else node.meta.get(IN_PYTORCH)
        if kept_reason:
            graph_report.kept.append(FallbackNode(graph_report.name, node.name, str(node.target),
                                                  kept_reason, user_source(node)))
        if not is_compute(node) or node in in_pytorch:
            continue
        reason = support.reason(node)
        if reason:
            unsupported.append(FallbackNode(graph_report.name, node.name, str(node.target), reason,
                                            user_source(node)))
        else:
            graph_report.ort_nodes += 1
    refuse_or_warn(unsupported, policy, "has no ONNX lowering")
    graph_report.fallbacks.extend(unsupported)
    graph_report.torch_nodes += len(unsupported)

    calls = [n for n in gm.graph.nodes if n.op == "call_function" and n not in in_pytorch]
    if in_pytorch <= host_views and all(support.is_node_supported(None, n) for n in calls):
        # Everything runs on ORT (the usual case): one partition, reading only the graph's
        # inputs, so no cycle to look for (the proposal's search is 0.05 s of BERT's first step).
        proposed = [Partition(id=0, nodes=calls)] if calls else []
    else:
        proposed = CapabilityBasedPartitioner(gm, support, allows_single_node_partition=True).propose_partitions()
    if segments > 1:
        proposed = _in_segments(proposed, segments, gm)
    names = _fuse(gm, [p.nodes for p in proposed])
    graph_report.partitions += len(names)
    verdicts = {node.name: reason for node, reason in support.verdicts.items() if is_compute(node)}
    return Partitioned(gm, names, verdicts)


def refuse_or_warn(unsupported: list[FallbackNode], policy: FallbackPolicy, why: str) -> None:
    """Nodes that must run in PyTorch because their op ``why`` (``"has no ONNX lowering"``):
    ``UnsupportedOpError`` naming the first where the policy forbids it, else one warning per
    cause (op and reason), not per node or per graph."""
    if unsupported and not (policy & FallbackPolicy.UNSUPPORTED_OP):
        first = unsupported[0]
        raise UnsupportedOpError(
            f"{first.op} {why} and fallback_policy={policy} forbids running it in "
            f"PyTorch.\n  op: {first.op}\n  source: {first.source or '(unknown)'}\n  reason: {first.reason}"
            + (f"\n  ({len(unsupported) - 1} more unsupported node(s))" if len(unsupported) > 1 else ""))
    for fallback in unsupported:
        warn_once(f"ort_dynamo: {fallback.op} runs in PyTorch: {fallback.reason}"
                  f"{' (first at ' + fallback.source + ')' if fallback.source else ''}. "
                  "See ort_dynamo.report().", cause=(fallback.op, fallback.reason), stacklevel=3)


def warn_once(message: str, cause=None, stacklevel: int = 2) -> None:
    """``warnings.warn(message)`` unless ``cause`` (default: the message) was warned of since
    ``ort_dynamo.reset()``; ``stacklevel`` counts from the caller, as ``warnings.warn``'s."""
    cause = message if cause is None else cause
    if cause not in _WARNED:
        _WARNED.add(cause)
        warnings.warn(message, stacklevel=stacklevel + 1)


_KEPT_REASON = ("PyTorch's fused CUDA attention, kept by design (option cuda_torch_attention): "
                "stock ONNX Runtime has no attention backward")

#: Below this many nodes a segment's ORT run costs more than the memory it frees.
_MIN_SEGMENT_NODES = 32


def _in_segments(partitions: list[Partition], segments: int, gm: torch.fx.GraphModule) -> list[Partition]:
    """Cut each partition into up to ``segments`` runs of consecutive nodes (graph order).

    A graph's inputs are freed only after the run that reads them last. In one backward run
    every saved activation lives until the end; in segments, those of the last layers are
    gone before the first layers' gradients are computed, as in eager. Pieces that are
    intervals of one topological order cannot depend on each other in a cycle."""
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    pieces = []
    for part in partitions:
        nodes = sorted(part.nodes, key=order.__getitem__)
        heads = [n for n in nodes if n.target is not operator.getitem]
        # No run, the last one included, is shorter than _MIN_SEGMENT_NODES: a short tail would
        # be a run of its own that frees nothing and cuts a chain the kernels fuse.
        runs = max(1, min(segments, len(heads) // _MIN_SEGMENT_NODES))
        size = -(-len(heads) // runs)
        cuts = _cheap_cuts(heads, size, shortest=_MIN_SEGMENT_NODES)
        piece_of, piece = {}, 0
        for i, node in enumerate(heads):
            piece += i in cuts
            piece_of[node] = piece
        _place_constants_with_their_readers(heads, piece_of)
        for node in nodes:  # a tuple's items go with the node that made it
            if node.target is operator.getitem:
                piece_of[node] = piece_of.get(node.args[0], 0)
        for k in range(max(piece_of.values(), default=-1) + 1):
            members = [n for n in nodes if piece_of[n] == k]
            if members:
                pieces.append(Partition(id=len(pieces), nodes=members))
    return pieces


def _cheap_cuts(heads: list[torch.fx.Node], size: int, shortest: int = 1) -> set[int]:
    """Where to cut ``heads`` (a partition's nodes in graph order, tuple items left out) into
    runs of about ``size`` nodes, none shorter than ``shortest``: each cut within a third of
    ``size`` of the even one, where the fewest bytes cross it (values made before and read
    after, which PyTorch holds between the two runs). An even cut can fall inside a layer's
    backward and hand over a dozen tensors where the layer's boundary hands over one."""
    at = {node: i for i, node in enumerate(heads)}
    crossing = [0] * (len(heads) + 1)  # bytes live across the cut before heads[i]
    for i, node in enumerate(heads):
        readers = [r for u in node.users for r in (u.users if u.target is operator.getitem else [u])]
        last = max((at[r] for r in readers if r in at), default=i)
        if last > i:
            made = _bytes(node)
            crossing[i + 1] += made
            crossing[last + 1] -= made
    for i in range(1, len(crossing)):
        crossing[i] += crossing[i - 1]
    cuts, previous, slack = set(), 0, size // 3
    for even in range(size, len(heads), size):
        window = range(max(previous + shortest, even - slack), min(len(heads) - shortest, even + slack) + 1)
        if window:
            previous = min(window, key=lambda i: (crossing[i], abs(i - even)))
            cuts.add(previous)
    return cuts


def _bytes(node: torch.fx.Node) -> int:
    """The bytes of what ``node`` makes (its tensors; a tuple's items), per its fake value."""
    value = node.meta.get("val")
    values = value if isinstance(value, (tuple, list)) else [value]
    total = 0
    for v in values:
        if isinstance(v, torch.Tensor):
            numel = v.numel()  # a symbolic size counts as one element: no guard on it
            total += (numel if isinstance(numel, int) else 1) * v.element_size()
    return total


def _place_constants_with_their_readers(heads: list[torch.fx.Node], piece_of: dict) -> None:
    """Nodes made from no tensor at all (the zeros a gradient starts from, an arange), and
    views, go to the first segment that reads them. Left where the graph order puts them, a
    constant would be made segments earlier and held in between, and ORT would see zeros it
    cannot fold away (``_pointwise._constant_zeros``); a view would reach the next segment
    as a separate, materialized tensor (an expanded index: ``_pointwise._scatter_add_rows``
    then no longer sees the Expand). Its base crosses instead, the same memory."""
    constant = set()
    for node in heads:
        if all(a in constant for a in node.all_input_nodes):
            constant.add(node)
    for node in reversed(heads):  # readers first, so a chain follows its last reader
        readers = list(node.users)
        if (node in constant or node.target in _WHOLE_INPUT_VIEWS) and readers and all(u in piece_of for u in readers):
            piece_of[node] = max(piece_of[node], min(piece_of[u] for u in readers))


def _fuse(gm: torch.fx.GraphModule, partitions: list) -> list[str]:
    """Each partition's nodes (no cycle between partitions) become a submodule ``fused_N`` of
    ``gm``, called where the partition's last node was. What torch's ``fuse_by_partitions``
    does, without its per-submodule Python code (made lazily: export reads the graph, not
    the code) and without re-sorting and recompiling ``gm`` when the order is already valid
    (the usual case: one partition, or consecutive segments). ``gm`` is left to recompile."""
    graph = gm.graph
    order = {node: i for i, node in enumerate(graph.nodes)}
    names = []
    for nodes in partitions:
        nodes = sorted(nodes, key=order.__getitem__)
        name = f"fused_{len(names)}"
        sub, inputs, outputs = _as_graph(nodes)
        gm.add_submodule(name, _LazyGraphModule(gm, sub, class_name=name))
        _call_in_place_of(graph, nodes, name, inputs, outputs)
        names.append(name)
    if not _in_order(graph):  # a PyTorch node between two nodes of a partition reads the first
        stable_topological_sort(gm)
    return names


def _as_graph(nodes: list[torch.fx.Node]) -> tuple[torch.fx.Graph, list[torch.fx.Node], list[torch.fx.Node]]:
    """A graph of copies of ``nodes`` (in graph order), with a placeholder for each value they
    read from outside (in order of first use) and an output of each they compute for outside;
    and those outside values and computed nodes."""
    members = set(nodes)
    sub = torch.fx.Graph()
    placeholders: dict[torch.fx.Node, torch.fx.Node] = {}
    copies: dict[torch.fx.Node, torch.fx.Node] = {}

    def read(node: torch.fx.Node) -> torch.fx.Node:
        if node in members:
            return copies[node]
        if node not in placeholders:
            placeholders[node] = sub.placeholder(node.name, type_expr=node.type)
            placeholders[node].meta = dict(node.meta)
        return placeholders[node]

    for node in nodes:
        copies[node] = sub.node_copy(node, read)
    outputs = [node for node in nodes if any(user not in members for user in node.users)]
    sub.output(copies[outputs[0]] if len(outputs) == 1 else tuple(copies[n] for n in outputs))
    return sub, list(placeholders), outputs


def _call_in_place_of(graph: torch.fx.Graph, nodes: list[torch.fx.Node], name: str,
                      inputs: list[torch.fx.Node], outputs: list[torch.fx.Node]) -> None:
    """``nodes`` replaced by a call of submodule ``name`` after the last of them; readers
    outside take its result (one output) or its items."""
    members = set(nodes)
    with graph.inserting_after(nodes[-1]):
        call = graph.call_module(name, tuple(inputs))
    if len(outputs) == 1:
        outputs[0].replace_all_uses_with(call, lambda user: user not in members, propagate_meta=True)
    else:
        call.meta["val"] = tuple(node.meta.get("val") for node in outputs)
        with graph.inserting_after(call):  # each item right after the call: made last to first
            for i, node in reversed(list(enumerate(outputs))):
                item = graph.call_function(operator.getitem, (call, i))
                node.replace_all_uses_with(item, lambda user: user not in members, propagate_meta=True)
    for node in reversed(nodes):
        graph.erase_node(node)


def _in_order(graph: torch.fx.Graph) -> bool:
    seen: set[torch.fx.Node] = set()
    for node in graph.nodes:
        if any(arg not in seen for arg in node.all_input_nodes):
            return False
        seen.add(node)
    return True
