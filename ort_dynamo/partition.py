"""Partition: nodes with an ONNX lowering go to ORT, the rest stay in PyTorch."""

from __future__ import annotations

import dataclasses
import operator
import re
from typing import Callable
import warnings

import torch
import torch.fx
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
from torch.fx.passes.operator_support import OperatorSupportBase

from .errors import UnsupportedOpError
from .lower import TORCHLIB_WRONG
from .lowerings import dtype_refusal
from .options import FallbackPolicy
from .report import FallbackNode, GraphReport

__all__ = ["partition", "UnsupportedOpError", "Partitioned"]

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


class _OnnxSupport(OperatorSupportBase):
    def __init__(self, registry: Callable, known: dict[str, str] | None) -> None:
        from torch.onnx._internal.exporter import _dispatching

        self._dispatch = _dispatching.dispatch
        self._registry = registry  # called only when a node needs torchlib's verdict
        self._known = known or {}  # verdicts of an identical graph, from the on-disk cache
        self.verdicts: dict[torch.fx.Node, str] = {}  # node -> "" if supported, else the reason

    def reason(self, node: torch.fx.Node) -> str:
        if node in self.verdicts:
            return self.verdicts[node]
        if node.target is operator.getitem:
            source = node.args[0]
            verdict = self.reason(source) if isinstance(source, torch.fx.Node) else "not a tensor"
        elif not is_compute(node):
            verdict = "not a tensor computation"
        elif not isinstance(node.target, torch._ops.OpOverload):
            verdict = f"{node.target} is not an ATen op"
        elif node.target in TORCHLIB_WRONG:
            verdict = "torchlib's lowering of this op is wrong for training"
        elif any(isinstance(t, torch.Tensor) and (t.is_complex() or t.is_sparse or t.is_quantized)
                 for t in (*_tensor_args(node), *_tensor_outputs(node))):
            verdict = "complex, sparse or quantized tensors are not supported by ORT"
        elif refusal := dtype_refusal(node):
            verdict = refusal
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
        return node.op == "call_function" and self.reason(node) == ""


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
              graph_report: GraphReport, known: dict[str, str] | None = None) -> Partitioned:
    """Split ``gm`` into ORT-bound submodules (``fused_N``) and PyTorch nodes.

    ``registry`` is called (once) only if a node needs torchlib's verdict: ``known`` verdicts
    of an identical graph, from the on-disk cache, spare building it.
    Records each node left in PyTorch, with its reason and source line, in ``graph_report``.
    Raises ``UnsupportedOpError`` if that is not allowed by ``policy``.
    """
    support = _OnnxSupport(registry, known)
    unsupported = []
    for node in gm.graph.nodes:
        if not is_compute(node):
            continue
        reason = support.reason(node)
        if reason:
            unsupported.append(FallbackNode(graph_report.name, node.name, str(node.target), reason,
                                            user_source(node)))
        else:
            graph_report.ort_nodes += 1
    if unsupported and not (policy & FallbackPolicy.UNSUPPORTED_OP):
        first = unsupported[0]
        raise UnsupportedOpError(
            f"{first.op} has no ONNX lowering and fallback_policy={policy} forbids running it in "
            f"PyTorch.\n  op: {first.op}\n  source: {first.source or '(unknown)'}\n  reason: {first.reason}"
            + (f"\n  ({len(unsupported) - 1} more unsupported node(s))" if len(unsupported) > 1 else ""))
    for fallback in unsupported:
        cause = (fallback.op, fallback.reason)
        if cause not in _WARNED:  # one warning per cause, not per node or per graph
            _WARNED.add(cause)
            warnings.warn(f"ort_dynamo: {fallback.op} runs in PyTorch: {fallback.reason}"
                          f"{' (first at ' + fallback.source + ')' if fallback.source else ''}. "
                          "See ort_dynamo.report().", stacklevel=2)
    graph_report.fallbacks.extend(unsupported)
    graph_report.torch_nodes += len(unsupported)

    partitioner = CapabilityBasedPartitioner(gm, support, allows_single_node_partition=True)
    fused = partitioner.fuse_partitions(partitioner.propose_partitions())
    names = []
    for node in fused.graph.nodes:
        if node.op == "call_module" and node.target.startswith("fused_"):
            _copy_placeholder_meta(getattr(fused, node.target), node)
            names.append(node.target)
    graph_report.partitions += len(names)
    verdicts = {node.name: reason for node, reason in support.verdicts.items() if is_compute(node)}
    return Partitioned(fused, names, verdicts)


def _copy_placeholder_meta(sub: torch.fx.GraphModule, call: torch.fx.Node) -> None:
    """Fused submodules' placeholders lack ``val``; take it from the call's arguments."""
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    for placeholder, arg in zip(placeholders, call.args):
        if isinstance(arg, torch.fx.Node) and "val" in arg.meta:
            placeholder.meta["val"] = arg.meta["val"]
            placeholder.meta.setdefault("stack_trace", arg.meta.get("stack_trace"))
