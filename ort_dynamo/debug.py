"""``compare``: find the first step, activation and ONNX node where ort and eager part ways.

Two copies of the model train side by side for ``steps`` steps, randomness removed (same
seeds, dropout 0, ORT deterministic compute with graph optimizations and our rewrites off).
Every module output and its gradient is recorded in both runs; the first one (in PyTorch's
execution order) that differs beyond ``atol``/``rtol`` is the first divergence. The ORT
partitions that ran in that step are then replayed on the inputs they saw: each partition's
FX graph node by node in PyTorch against its ONNX model with every intermediate value
exposed as an output. The first node whose values differ is the culprit, reported with its
ONNX node and the saved ``.onnx`` file.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import importlib
import os
import runpy
import sys
import tempfile
from typing import Any, Callable, Mapping

import torch
import torch.fx

from . import run as run_stage
from .errors import OrtDynamoError
from .options import OrtOptions
from .report import current_report
from .partition import user_source
from .utils.hooks._recording_subscriber import RecordingSubscriber
from .utils.hooks._subscriber_manager import SubscriberManager, flatten_tensors

__all__ = ["compare", "CompareResult", "NodeDivergence", "main_compare"]

#: Float attributes some models use instead of ``nn.Dropout`` modules (HF attention classes).
_DROPOUT_ATTRIBUTES = ("attention_dropout", "attn_dropout", "dropout", "dropout_p", "dropout_rate")


@dataclasses.dataclass
class NodeDivergence:
    """The first node of an ORT partition whose ONNX value differs from PyTorch's."""

    graph: str          # e.g. "forward_3": the backend graph (see ort_dynamo.report())
    partition: str      # e.g. "fused_0"
    fx_node: str        # FX node name; also the ONNX value name
    fx_target: str      # e.g. "aten.tanh.default"
    onnx_node: str      # the ONNX node producing the value, e.g. "node_tanh"
    onnx_op: str        # its op type, e.g. "Tanh"
    onnx_path: str      # the saved ONNX model ("" if not saved)
    max_abs_diff: float
    source: str = ""    # the user's line that produced the FX node, when known

    def __str__(self) -> str:
        lines = [f"  FX node:    {self.fx_node} = {self.fx_target} (graph {self.graph}, partition {self.partition})",
                 f"  ONNX node:  {self.onnx_node} ({self.onnx_op}), max abs diff {self.max_abs_diff:.3g}"]
        if self.onnx_path:
            lines.append(f"  ONNX model: {self.onnx_path}")
            lines.append(f"  FX graph:   {self.onnx_path[:-len('.onnx')]}.fx.txt")
        if self.source:
            lines.append(f"  source:     {self.source}")
        return "\n".join(lines)


@dataclasses.dataclass
class CompareResult:
    diverged: bool
    steps: int
    eager_losses: list[float]
    ort_losses: list[float]
    step: int | None = None
    activation: str | None = None   # e.g. "NewGELUActivation_17_0th_output"
    kind: str | None = None         # "forward" (the activation) or "backward" (its gradient)
    max_abs_diff: float = 0.0
    node: NodeDivergence | None = None
    save_path: str = ""

    def __str__(self) -> str:
        head = f"ort_dynamo compare: {len(self.eager_losses)} of {self.steps} step(s) run; " \
               f"losses eager {_fmt_list(self.eager_losses)} " \
               f"ort {_fmt_list(self.ort_losses)}"
        if not self.diverged:
            return head + "\nno divergence: every activation and gradient matches within tolerance"
        what = "gradient of" if self.kind == "backward" else "activation"
        lines = [head, f"first divergence: step {self.step}, {what} {self.activation} "
                       f"(max abs diff {self.max_abs_diff:.3g})"]
        if self.node is not None:
            lines.append(str(self.node))
        else:
            lines.append("  every ORT partition of that step matches PyTorch node by node on its own "
                         "inputs: the difference comes from the PyTorch side or the graph splitting")
        return "\n".join(lines)


def _fmt_list(values: list[float]) -> str:
    return "[" + ", ".join(f"{v:.6g}" for v in values) + "]"


# ---- running the two models -----------------------------------------------------------------


def _remove_randomness(model: torch.nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            module.p = 0.0
        for attr in _DROPOUT_ATTRIBUTES:
            if isinstance(getattr(module, attr, None), float):
                setattr(module, attr, 0.0)


def _copies(model_or_fn, seed: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    if isinstance(model_or_fn, torch.nn.Module):
        base = getattr(model_or_fn, "_orig_mod", model_or_fn)
        made = [copy.deepcopy(base), copy.deepcopy(base)]
    elif callable(model_or_fn):
        made = []
        for _ in range(2):
            torch.manual_seed(seed)
            made.append(model_or_fn())
        if not all(isinstance(m, torch.nn.Module) for m in made):
            raise TypeError(f"compare: the model factory returned {type(made[0]).__name__}, not an nn.Module")
    else:
        raise TypeError(f"compare needs an nn.Module or a function returning one, got {type(model_or_fn).__name__}")
    for m in made:
        _remove_randomness(m)
        m.train()
    return made[0], made[1]


def _batch(inputs, step: int):
    if callable(inputs) and not isinstance(inputs, (torch.Tensor, torch.nn.Module)):
        return inputs(step)
    return inputs


def _call(model, batch):
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    if isinstance(batch, torch.Tensor):
        return model(batch)
    raise TypeError("compare: inputs must be a tensor, a tuple/list of positional arguments, a dict of "
                    f"keyword arguments, or a function step -> one of those; got {type(batch).__name__}")


def default_loss(output, batch) -> torch.Tensor:
    """``output.loss`` when the model computes one (Hugging Face), else the sum of the first output."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    tensors = flatten_tensors(output)
    if not tensors:
        raise TypeError("compare: the model returned no tensor; pass loss_fn=(output, batch) -> scalar")
    return tensors[0].float().sum()


@contextlib.contextmanager
def _recording_runner_calls(calls: list):
    """Record each OrtRunner call with copies of its inputs (for replaying node by node)."""
    original = run_stage.OrtRunner.__call__

    def recording(runner, *args):
        calls.append((runner, tuple(a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args)))
        return original(runner, *args)

    run_stage.OrtRunner.__call__ = recording
    try:
        yield
    finally:
        run_stage.OrtRunner.__call__ = original


def _nothing_on_ort(step: int, breaks_before: dict) -> str:
    """Why a comparison cannot be made: the "ort" copy ran eagerly, so it would match eager."""
    breaks = [reason for reason, n in current_report().graph_breaks.items() if n > breaks_before.get(reason, 0)]
    reasons = "; ".join(reason.strip().splitlines()[0] for reason in breaks) or "none reported"
    return (f"compare: nothing of the model ran on ONNX Runtime in step {step}, so eager would only be "
            f"compared with itself. Dynamo compiled no graph around the activation hooks "
            f"(its graph breaks: {reasons}); see docs/convergence.md")


def _train_step(model, optimizer, batch, loss_fn) -> float:
    optimizer.zero_grad(set_to_none=True)
    loss = loss_fn(_call(model, batch), batch)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TypeError(f"compare: loss_fn must return a scalar tensor, got {loss!r:.80}")
    loss.backward()
    optimizer.step()
    return float(loss.detach())


def _difference(reference: torch.Tensor, value: torch.Tensor, atol: float, rtol: float) -> float | None:
    """Max abs difference if ``value`` is not close to ``reference``, else None."""
    if reference.shape != value.shape:
        return float("inf")
    a, b = reference.to(torch.float64), value.to(torch.float64)
    if torch.isclose(b, a, rtol=rtol, atol=atol, equal_nan=True).all():
        return None
    diff = (a - b).abs()
    diff = torch.where(torch.isnan(a) ^ torch.isnan(b), torch.full_like(diff, float("inf")), diff)
    return float(torch.nan_to_num(diff, nan=0.0).max())


# ---- replaying a partition node by node ------------------------------------------------------


class _RecordingInterpreter(torch.fx.Interpreter):
    def __init__(self, gm: torch.fx.GraphModule) -> None:
        super().__init__(gm)
        self.values: dict[str, Any] = {}

    def run_node(self, node: torch.fx.Node):
        result = super().run_node(node)
        self.values[node.name] = result
        return result


def _onnx_with_intermediates(model_bytes: bytes, names: set[str]):
    """The model with each value named in ``names`` (FX node names) also a graph output."""
    import onnx
    import onnx_ir as ir

    model = ir.serde.deserialize_model(onnx.load_model_from_string(model_bytes))
    graph = model.graph
    taken = {v.name for v in graph.outputs} | {v.name for v in graph.inputs} | set(graph.initializers)
    producers = {}
    for node in graph:
        for value in node.outputs:
            producers[value.name] = node
            if value.name in names and value.name not in taken and value.type is not None:
                graph.outputs.append(value)
                taken.add(value.name)
    return ir.serde.serialize_model(model).SerializeToString(), producers


def _first_bad_node(runner, args: tuple, atol: float, rtol: float) -> NodeDivergence | None:
    import onnxruntime as ort

    gm = runner.torch_fn
    interpreter = _RecordingInterpreter(gm)
    with torch.no_grad():
        interpreter.run(*args)
    compute = [n for n in gm.graph.nodes if n.op == "call_function"]
    model_bytes, producers = _onnx_with_intermediates(runner.model_bytes, {n.name for n in compute})
    device = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
    library = runner.kernel_library.result() if runner.kernel_library else ""  # the model's custom ops
    session = ort.InferenceSession(model_bytes, run_stage.session_options(runner.options, device.type, library,
                                                                           model=model_bytes,
                                                                           torch_threads=runner.exported.torch_threads),
                                   providers=run_stage.providers_for(device, runner.options))
    feeds = {}
    exported = runner.exported
    for index, (name, arg, kind) in enumerate(zip(exported.input_names, args, exported.input_kinds)):
        tensor = exported.ort_layout(index, arg) if kind == "tensor" else run_stage._scalar_tensor(arg, device)
        feeds[name] = tensor.detach().cpu().contiguous().numpy()
    output_names = [o.name for o in session.get_outputs()]
    onnx_values = dict(zip(output_names, session.run(output_names, feeds)))
    for node in compute:
        expected = interpreter.values.get(node.name)
        if node.name not in onnx_values or not isinstance(expected, torch.Tensor):
            continue
        got = torch.from_numpy(onnx_values[node.name])
        diff = _difference(expected.detach().cpu(), got, atol, rtol)
        if diff is None:
            continue
        producer = producers.get(node.name)
        return NodeDivergence(
            graph=runner.report.name, partition=runner.name, fx_node=node.name,
            fx_target=_target_name(node.target),
            onnx_node=producer.name if producer is not None else "",
            onnx_op=producer.op_type if producer is not None else "",
            onnx_path=_saved_path(runner), max_abs_diff=diff, source=user_source(node))
    return None


def _target_name(target) -> str:
    name = str(target)
    return name if not name.startswith("aten::") else "aten." + name[len("aten::"):]


def _saved_path(runner) -> str:
    suffix = f"_{runner.report.name}_{runner.name}.onnx"
    return next((p for p in runner.report.onnx_paths if p.endswith(suffix)), "")


# ---- the API ---------------------------------------------------------------------------------


def compare(model: torch.nn.Module | Callable[[], torch.nn.Module], inputs, steps: int = 1, *,
            loss_fn: Callable | None = None, atol: float = 1e-4, rtol: float = 1e-3, lr: float = 1e-2,
            seed: int = 0, save_path: str | None = None, options: Mapping[str, Any] | None = None,
            verbose: bool = True) -> CompareResult:
    """Train eager and ``backend="ort"`` copies of ``model`` side by side; report the first divergence.

    Args:
        model: the model (deep-copied twice, untouched) or a function building it.
        inputs: the batch of every step: a tensor, a tuple of positional arguments, a dict of
            keyword arguments, or a function ``step -> batch``.
        steps: training steps (SGD with learning rate ``lr`` after each backward).
        loss_fn: ``(output, batch) -> scalar``; default ``output.loss`` or the first output's sum.
        atol, rtol: an activation or gradient diverges where ``|ort - eager| > atol + rtol * |eager|``.
        save_path: where the ONNX models are saved (default: a new temporary folder).
        options: extra ``OrtOptions`` fields for the ort run (deterministic compute is forced).
        verbose: print the result.

    Side effect: resets Dynamo (``torch._dynamo.reset()``) so both copies compile afresh.
    """
    from .capture import OrtBackend

    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"compare: steps must be an int >= 1, got {steps!r}")
    if atol < 0 or rtol < 0:
        raise ValueError(f"compare: atol and rtol must be >= 0, got atol={atol}, rtol={rtol}")
    loss_fn = loss_fn or default_loss
    save_path = save_path or tempfile.mkdtemp(prefix="ort_dynamo_compare_")
    ort_options = dataclasses.replace(
        OrtOptions.from_mapping(options), deterministic_compute=True, enable_compute_optimizer=False,
        save_onnx=True, save_path=save_path)

    eager_model, ort_model = _copies(model, seed)
    torch._dynamo.reset()
    compiled = torch.compile(ort_model, backend=OrtBackend(ort_options))
    runs = {}
    for label, module, target in (("eager", eager_model, eager_model), ("ort", ort_model, compiled)):
        recorder = RecordingSubscriber()
        manager = SubscriberManager()
        manager.subscribe(module, [recorder])
        runs[label] = (target, torch.optim.SGD(module.parameters(), lr=lr), recorder, manager)

    result = CompareResult(diverged=False, steps=steps, eager_losses=[], ort_losses=[], save_path=save_path)
    breaks_before = current_report().graph_breaks
    try:
        for step in range(steps):
            batch = _batch(inputs, step)
            target, optimizer, eager_rec, _ = runs["eager"]
            torch.manual_seed(seed + step)
            result.eager_losses.append(_train_step(target, optimizer, batch, loss_fn))
            target, optimizer, ort_rec, _ = runs["ort"]
            torch.manual_seed(seed + step)
            calls: list = []
            with _recording_runner_calls(calls):
                result.ort_losses.append(_train_step(target, optimizer, batch, loss_fn))
            if not calls:
                raise OrtDynamoError(_nothing_on_ort(step, breaks_before))
            if _find_divergence(result, step, eager_rec.pop(step), ort_rec.pop(step), atol, rtol):
                for runner, args in calls:
                    result.node = _first_bad_node(runner, args, atol, rtol)
                    if result.node is not None:
                        break
                break
    finally:
        for _, _, _, manager in runs.values():
            manager.unsubscribe()
    if verbose:
        print(result)
    return result


def _find_divergence(result: CompareResult, step: int, eager: dict, ort: dict,
                     atol: float, rtol: float) -> bool:
    for (kind, name), reference in eager.items():
        value = ort.get((kind, name))
        if value is None:
            continue  # not every activation needs a gradient in both runs
        diff = _difference(reference, value, atol, rtol)
        if diff is not None:
            result.diverged, result.step, result.activation = True, step, name
            result.kind, result.max_abs_diff = kind, diff
            return True
    return False


# ---- the command line ------------------------------------------------------------------------


def _load_target(spec: str) -> dict:
    if spec.endswith(".py") or os.path.sep in spec:
        if not os.path.exists(spec):
            raise FileNotFoundError(f"no such script: {spec}")
        return runpy.run_path(spec, run_name="ort_dynamo_compare_target")
    return vars(importlib.import_module(spec))


def main_compare(argv: list[str] | None = None) -> int:
    """``python -m ort_dynamo compare SCRIPT_OR_MODULE``: 0 = no divergence, 1 = divergence, 2 = error.

    The script (or module) defines ``get_model()`` -> nn.Module and ``get_inputs()`` -> the
    batch (see ``compare``'s ``inputs``), and optionally ``loss_fn(output, batch)``.
    """
    parser = argparse.ArgumentParser(prog="python -m ort_dynamo compare",
                                     description="First step/activation/ONNX node where ort and eager differ.")
    parser.add_argument("target", help="a script path or module name defining get_model() and get_inputs()")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--atol", type=float, default=1e-4)
    parser.add_argument("--rtol", type=float, default=1e-3)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--save-path", default=None, help="folder for the ONNX models (default: a temp folder)")
    args = parser.parse_args(argv)
    try:
        namespace = _load_target(args.target)
        missing = [name for name in ("get_model", "get_inputs") if not callable(namespace.get(name))]
        if missing:
            raise ValueError(f"{args.target} must define {' and '.join(missing)}()")
        result = compare(namespace["get_model"], namespace["get_inputs"](), steps=args.steps,
                         loss_fn=namespace.get("loss_fn"), atol=args.atol, rtol=args.rtol, lr=args.lr,
                         save_path=args.save_path, verbose=True)
    except (OSError, ValueError, TypeError, ImportError, OrtDynamoError) as exc:
        print(f"ort_dynamo compare: error: {exc}", file=sys.stderr)
        return 2
    return 1 if result.diverged else 0
