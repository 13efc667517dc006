"""What was compiled, what runs on ORT, what fell back to PyTorch and why."""

from __future__ import annotations

import atexit
import collections
import contextlib
import dataclasses
import json
import os
import threading
import time
from typing import Iterator

__all__ = ["FallbackNode", "GraphReport", "Report", "current_report", "clear_report", "format_report"]


@dataclasses.dataclass
class FallbackNode:
    """One FX node (or whole partition) that runs in PyTorch instead of ORT."""

    graph: str
    node: str
    op: str
    reason: str
    source: str = ""

    def __str__(self) -> str:
        where = f" at {self.source}" if self.source else ""
        return f"{self.op} ({self.node}){where}: {self.reason}"


@dataclasses.dataclass
class GraphReport:
    """One graph handed to the backend: a forward, backward or inference graph."""

    name: str
    kind: str  # "forward" | "backward" | "inference"
    ort_nodes: int = 0
    torch_nodes: int = 0
    partitions: int = 0
    fallbacks: list[FallbackNode] = dataclasses.field(default_factory=list)
    #: Nodes kept in PyTorch by design: faster there, or random draws (not counted as fallbacks).
    kept: list[FallbackNode] = dataclasses.field(default_factory=list)
    stage_seconds: dict[str, float] = dataclasses.field(default_factory=lambda: collections.defaultdict(float))
    sessions: int = 0
    exports: int = 0
    cache_hits: int = 0
    #: Generated pointwise kernels (fused elementwise chains) the graph's partitions use.
    kernels: int = 0
    runs: int = 0
    #: Values the graph returns; for a forward graph, user outputs plus what backward saves.
    outputs: int = 0
    #: Execution providers of the sessions created (first = the one that runs the graph).
    providers: list[str] = dataclasses.field(default_factory=list)
    onnx_paths: list[str] = dataclasses.field(default_factory=list)

    def partition_to_pytorch(self, partition: str, reason: str, nodes: int) -> None:
        """A whole ORT partition runs in PyTorch (export or runtime failure): record why and
        move its ``nodes`` compute nodes from the ORT count to the PyTorch count."""
        self.fallbacks.append(FallbackNode(self.name, partition, "partition", reason))
        self.ort_nodes -= nodes
        self.torch_nodes += nodes

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.stage_seconds[name] += time.perf_counter() - start


class Report:
    """The backend's record since the last ``ort_dynamo.reset()``.

    ``ort_nodes`` and ``fallback_nodes`` total the compute nodes over all graphs.
    """

    def __init__(self) -> None:
        self.graphs: list[GraphReport] = []
        self._lock = threading.Lock()
        self._counter = collections.Counter()
        self._breaks_before = collections.Counter(_dynamo_graph_breaks())
        #: Why ``memory_opt_level=1`` kept every activation of a graph (its min-cut failed).
        self.recompute_failures: list[str] = []

    @property
    def graph_breaks(self) -> dict[str, int]:
        """Dynamo graph breaks since this report began, by reason: code Dynamo could not
        capture runs eagerly in Python between compiled graphs, or a whole frame does when
        Dynamo gave up on it (not an ORT fallback)."""
        now = collections.Counter(_dynamo_graph_breaks())
        now.subtract(self._breaks_before)
        return {reason: n for reason, n in now.items() if n > 0}

    def new_graph(self, kind: str) -> GraphReport:
        with self._lock:
            self._counter[kind] += 1
            graph = GraphReport(name=f"{kind}_{self._counter[kind] - 1}", kind=kind)
            self.graphs.append(graph)
            return graph

    @property
    def ort_nodes(self) -> int:
        return sum(g.ort_nodes for g in self.graphs)

    @property
    def fallback_nodes(self) -> int:
        return sum(g.torch_nodes for g in self.graphs)

    @property
    def fallbacks(self) -> list[FallbackNode]:
        return [f for g in self.graphs for f in g.fallbacks]

    @property
    def kept_nodes(self) -> int:
        """Nodes kept in PyTorch by design (faster there, or random draws), not counted in
        ``fallback_nodes``."""
        return sum(len(g.kept) for g in self.graphs)

    @property
    def sessions(self) -> int:
        return sum(g.sessions for g in self.graphs)

    @property
    def exports(self) -> int:
        return sum(g.exports for g in self.graphs)

    @property
    def kernels(self) -> int:
        return sum(g.kernels for g in self.graphs)

    @property
    def runs(self) -> int:
        return sum(g.runs for g in self.graphs)

    def stage_seconds(self) -> dict[str, float]:
        return _summed_stages(g.stage_seconds for g in self.graphs)

    def to_dict(self) -> dict:
        return {
            "ort_nodes": self.ort_nodes,
            "fallback_nodes": self.fallback_nodes,
            "kept_nodes": self.kept_nodes,
            "sessions": self.sessions,
            "exports": self.exports,
            "kernels": self.kernels,
            "graph_breaks": self.graph_breaks,
            "recompute_failures": self.recompute_failures,
            "graphs": [
                {f.name: getattr(g, f.name) for f in dataclasses.fields(g)
                 if f.name not in ("fallbacks", "kept", "stage_seconds")}
                | {"stage_seconds": dict(g.stage_seconds), "fallbacks": [dataclasses.asdict(f) for f in g.fallbacks],
                   "kept": [dataclasses.asdict(f) for f in g.kept]}
                for g in self.graphs
            ],
        }

    def save(self, path: str) -> None:
        with open(path, "w") as fh:
            json.dump(self.to_dict(), fh, indent=2)

    def __str__(self) -> str:
        return format_report(self.to_dict())

    __repr__ = __str__


def format_report(data: dict, path: str = "") -> str:
    """The report's table from ``Report.to_dict()``: what ``print(ort_dynamo.report())`` shows,
    and ``python -m ort_dynamo report`` from a saved JSON (``path``: where it was read)."""
    graphs = data["graphs"]
    kernels = f", {data['kernels']} pointwise kernel(s)" if "kernels" in data else ""  # older reports lack it
    lines = [f"ort_dynamo report{f' ({path})' if path else ''}: {len(graphs)} graph(s), "
             f"{data['ort_nodes']} node(s) on ORT, {data['fallback_nodes']} in PyTorch, "
             f"{data['sessions']} session(s), {data['exports']} export(s){kernels}"]
    header = f"{'graph':<14}{'kind':<11}{'on ORT':>8}{'PyTorch':>9}{'parts':>7}{'sessions':>10}{'runs':>7}"
    lines += [header, "-" * len(header)]
    for g in graphs:
        lines.append(f"{g['name']:<14}{g['kind']:<11}{g['ort_nodes']:>8}{g['torch_nodes']:>9}"
                     f"{g['partitions']:>7}{g['sessions']:>10}{g['runs']:>7}")
    stages = _summed_stages(g.get("stage_seconds", {}) for g in graphs)
    if stages:
        lines.append("time per stage: " + ", ".join(f"{k} {v:.3f}s" for k, v in stages.items()))
    breaks = data.get("graph_breaks", {})
    if breaks:
        lines.append(f"Dynamo graph breaks ({sum(breaks.values())}):")
        shown = collections.Counter()
        for reason, n in breaks.items():  # reasons that read the same on one line are one
            shown[_break_line(reason)] += n
        lines += [f"  {n} x {line}" for line, n in shown.most_common()]
    failures = data.get("recompute_failures", [])
    if failures:
        lines.append("memory_opt_level=1 kept every activation of a graph (min-cut failed):")
        lines += [f"  {reason}" for reason in failures]
    kept = collections.Counter((f["op"], f["reason"]) for g in graphs for f in g.get("kept", []))
    if kept:
        lines.append("kept in PyTorch by design (not fallbacks):")
        lines += [f"  {n} x {op}: {reason}" for (op, reason), n in kept.items()]
    fallbacks = [FallbackNode(**f) for g in graphs for f in g.get("fallbacks", [])]
    if fallbacks:
        lines.append("fell back to PyTorch:")
        lines += [f"  [{f.graph}] {f}" for f in fallbacks]
    return "\n".join(lines)


def _summed_stages(per_graph) -> dict[str, float]:
    """Seconds per stage over all graphs, from each graph's stage -> seconds."""
    total: dict[str, float] = collections.defaultdict(float)
    for stages in per_graph:
        for stage, seconds in stages.items():
            total[stage] += seconds
    return dict(total)


def _dynamo_graph_breaks() -> dict:
    """Dynamo counts each reason once: under "graph_break" when it split the graph at a call,
    under "unimplemented" when it split at a data-dependent branch or gave up on a whole frame
    (an ``nn.LSTM`` without ``allow_rnn``: nothing of that frame compiled)."""
    from torch._dynamo.utils import counters

    return dict(collections.Counter(counters["graph_break"]) + collections.Counter(counters["unimplemented"]))


def _break_line(reason: str) -> str:
    """A reason's first line, Dynamo's first hint when it gives one, and its debug context
    (which call: the same reason at two places differs there), shortened."""
    lines = [line.strip() for line in reason.strip().splitlines()]
    hint = next((line for line in lines if line.startswith("Hint:")), "")
    context = next((line for line in lines if line.startswith("Developer debug context:")), "")
    line = f"{lines[0]} ({hint[len('Hint:'):].strip()})" if hint else lines[0]
    context = context[len("Developer debug context:"):].strip()
    if context:
        line += ": " + (context if len(context) <= 160 else context[:157] + "...")
    return line


_REPORT = Report()


def _save_at_exit() -> None:
    """``ORT_DYNAMO_REPORT_PATH=path`` saves the report when the process ends (``{rank}`` in
    the path is replaced by the distributed rank), for ``python -m ort_dynamo report``."""
    path = os.environ.get("ORT_DYNAMO_REPORT_PATH")
    if path and _REPORT.graphs:
        path = path.replace("{rank}", os.environ.get("RANK", "0"))
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        _REPORT.save(path)


atexit.register(_save_at_exit)


def current_report() -> Report:
    return _REPORT


def clear_report() -> None:
    global _REPORT
    _REPORT = Report()

