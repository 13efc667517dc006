"""Runtime inspectors: input density and memory statistics, printed once per step.

``attach(model, options)`` turns them on as ``options.print_input_density`` /
``options.print_memory_stats`` say (env ORT_DYNAMO_PRINT_INPUT_DENSITY / ORTMODULE_PRINT_INPUT_DENSITY,
ORT_DYNAMO_PRINT_MEMORY_STATS / ORTMODULE_PRINT_MEMORY_STATS). A step is one call of the
top-level module.

* Input density: for each ``nn.Embedding`` with a ``padding_idx``, the share of its input
  ids that are not padding; for ``labels`` inputs of the top-level module, the share not
  equal to ``ignore_index`` (-100). Under ``torch.compile`` the embedding hooks run eagerly:
  Dynamo breaks the graph before each such embedding (usually the model's first op).
* Memory: on CUDA, ``torch.cuda`` allocated / reserved / peak; on CPU, the process's
  resident set (``/proc/self/statm``) and its peak (``resource.getrusage``).
"""

from __future__ import annotations

import dataclasses
import os
import resource
import sys
from typing import Callable, Mapping

import torch

from .options import OrtOptions, resolve_options

__all__ = ["attach", "InputDensityInspector", "MemoryInspector", "Inspectors", "memory_stats", "IGNORE_INDEX"]

#: The label value loss functions skip (``nn.CrossEntropyLoss``'s default ``ignore_index``).
IGNORE_INDEX = -100
_MIB = 1024 * 1024


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    while isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):
        model = model._orig_mod
    return model


@dataclasses.dataclass
class Density:
    """One input's padding: ``valid`` of ``total`` elements are not padding/ignored."""

    name: str
    total: int
    valid: int

    @property
    def density(self) -> float:
        return self.valid / self.total if self.total else 1.0

    def __str__(self) -> str:
        return f"{self.name}: {self.valid}/{self.total} valid ({100 * self.density:.2f}% density)"


class InputDensityInspector:
    """Counts padding in embedding inputs and ignored labels; ``observe_*`` per step."""

    def __init__(self, label_names: tuple[str, ...] = ("labels",), ignore_index: int = IGNORE_INDEX) -> None:
        self.label_names = label_names
        self.ignore_index = ignore_index
        self.current: list[Density] = []

    def observe_embedding(self, name: str, ids: torch.Tensor, padding_idx: int) -> Density:
        found = Density(f"embedding {name} (padding_idx={padding_idx})", ids.numel(),
                        int((ids != padding_idx).sum()))
        self.current.append(found)
        return found

    def observe_labels(self, name: str, labels: torch.Tensor) -> Density:
        found = Density(f"label {name} (ignore_index={self.ignore_index})", labels.numel(),
                        int((labels != self.ignore_index).sum()))
        self.current.append(found)
        return found

    def take(self) -> list[Density]:
        found, self.current = self.current, []
        return found


def memory_stats(device: torch.device | None = None) -> dict[str, float]:
    """Memory in MiB: for a CUDA ``device`` PyTorch's allocator figures and the device's memory
    in use, else the process's RSS. ORT allocates its CUDA tensors from its own arena, which
    PyTorch's figures do not see; ``device_used_mib`` does (with everything else on the device)."""
    if device is not None and device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return {
            "allocated_mib": torch.cuda.memory_allocated(device) / _MIB,
            "reserved_mib": torch.cuda.memory_reserved(device) / _MIB,
            "peak_allocated_mib": torch.cuda.max_memory_allocated(device) / _MIB,
            "device_used_mib": (total - free) / _MIB,
        }
    stats = {"peak_rss_mib": _peak_rss_bytes() / _MIB}
    rss = _rss_bytes()
    if rss is not None:
        stats = {"rss_mib": rss / _MIB, **stats}
    return stats


def _rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None  # no procfs (macOS): only the peak is known


def _peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


class MemoryInspector:
    def line(self, device: torch.device | None) -> str:
        return ", ".join(f"{k} {v:.1f}" for k, v in memory_stats(device).items())


class Inspectors:
    """The hooks ``attach`` installed; ``detach()`` removes them."""

    def __init__(self, density: InputDensityInspector | None, memory: MemoryInspector | None,
                 printer: Callable[[str], None]) -> None:
        self.density = density
        self.memory = memory
        self.printer = printer
        self.step = 0
        self.device: torch.device | None = None
        self.handles: list = []

    def detach(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    @torch._dynamo.disable
    def _embedding_hook(self, name: str, module: torch.nn.Embedding, args) -> None:
        if args and isinstance(args[0], torch.Tensor):
            self.density.observe_embedding(name, args[0], module.padding_idx)

    @torch._dynamo.disable
    def _root_pre_hook(self, module, args, kwargs) -> None:
        tensors = [a for a in args if isinstance(a, torch.Tensor)] + \
            [v for v in kwargs.values() if isinstance(v, torch.Tensor)]
        if tensors:
            self.device = tensors[0].device
        if self.density is not None:
            for name in self.density.label_names:
                if isinstance(kwargs.get(name), torch.Tensor):
                    self.density.observe_labels(name, kwargs[name])

    @torch._dynamo.disable
    def _root_post_hook(self, module, args, kwargs, output) -> None:
        if self.density is not None:
            found = self.density.take()
            if found:
                self.printer(f"[ort_dynamo] step {self.step} input density: " + "; ".join(map(str, found)))
        if self.memory is not None:
            self.printer(f"[ort_dynamo] step {self.step} memory (MiB): {self.memory.line(self.device)}")
        self.step += 1


def attach(model: torch.nn.Module, options: OrtOptions | Mapping | None = None, *,
           label_names: tuple[str, ...] = ("labels",), ignore_index: int = IGNORE_INDEX,
           printer: Callable[[str], None] | None = None) -> Inspectors | None:
    """Print input density and/or memory statistics per step of ``model``, as ``options`` say.

    Returns the installed ``Inspectors`` (``.detach()`` removes them), or None when both
    options are off. Works on an eager model and on a ``torch.compile``d one.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"attach needs a torch.nn.Module, got {type(model).__name__}")
    options = resolve_options(options)
    if not (options.print_input_density or options.print_memory_stats):
        return None
    root = _unwrap(model)
    printer = printer or (lambda line: print(line, flush=True))
    density = InputDensityInspector(tuple(label_names), ignore_index) if options.print_input_density else None
    inspectors = Inspectors(density, MemoryInspector() if options.print_memory_stats else None, printer)
    if density is not None:
        for name, module in root.named_modules():
            if isinstance(module, torch.nn.Embedding) and module.padding_idx is not None:
                hook = (lambda n: lambda m, a: inspectors._embedding_hook(n, m, a))(name)
                inspectors.handles.append(module.register_forward_pre_hook(hook))
    inspectors.handles.append(root.register_forward_pre_hook(inspectors._root_pre_hook, with_kwargs=True))
    inspectors.handles.append(root.register_forward_hook(inspectors._root_post_hook, with_kwargs=True))
    torch._dynamo.reset()  # compiled code would not run hooks added after it was traced
    return inspectors


# ---- backend side: the same printouts from options, without access to the user's module ----

_aten = torch.ops.aten
_PASS_THROUGH = {_aten.view.default, _aten.reshape.default, _aten._unsafe_view.default, _aten.clone.default,
                 _aten.slice.Tensor, _aten.unsqueeze.default, _aten.squeeze.dim, _aten.t.default,
                 _aten.expand.default, _aten.alias.default}


def _source_placeholder(node):
    """The graph input a value is a view/reshape of, or None."""
    while isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in _PASS_THROUGH:
        node = node.args[0]
    return node if isinstance(node, torch.fx.Node) and node.op == "placeholder" else None


def watch_graph(gm: torch.fx.GraphModule, options: OrtOptions, graph_name: str,
                printer: Callable[[str], None] = print) -> Callable[[Callable], Callable]:
    """Read ``gm`` (before partitioning) and return a wrapper for its compiled form (boxed
    calling convention) that prints, per call, the input density of embedding ids
    (``padding_idx``) and labels (``ignore_index`` -100) entering the graph, and memory
    statistics: options ``print_input_density`` / ``print_memory_stats``."""
    if not (options.print_input_density or options.print_memory_stats):
        return lambda compiled: compiled
    placeholders = {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    watched: list[tuple[str, int, int]] = []  # (kind, input index, padding value)
    if options.print_input_density:
        for node in gm.graph.nodes:
            if node.op != "call_function":
                continue
            if node.target is _aten.embedding.default and len(node.args) > 2 and node.args[2] >= 0:
                source = _source_placeholder(node.args[1])
                if source is not None:
                    watched.append(("embedding", placeholders[source], node.args[2]))
            elif node.target is _aten.ne.Scalar and node.args[1] == IGNORE_INDEX:
                source = _source_placeholder(node.args[0])
                if source is not None and ("label", placeholders[source], IGNORE_INDEX) not in watched:
                    watched.append(("label", placeholders[source], IGNORE_INDEX))
    inspector, memory = InputDensityInspector(), MemoryInspector()
    calls = 0

    def wrap(compiled: Callable) -> Callable:
        def run(args):
            return _observed_call(compiled, args)

        run._boxed_call = True
        return run

    def _observed_call(compiled, args):
        nonlocal calls
        device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
        for kind, index, pad in watched:
            if kind == "embedding":
                inspector.observe_embedding(f"input {index}", args[index], pad)
            else:
                inspector.observe_labels(f"input {index}", args[index])
        out = compiled(args)
        found = inspector.take()
        if found:
            printer(f"[ort_dynamo] {graph_name} step {calls} input density: " + "; ".join(map(str, found)))
        if options.print_memory_stats:
            printer(f"[ort_dynamo] {graph_name} step {calls} memory (MiB): {memory.line(device)}")
        calls += 1
        return out

    return wrap
