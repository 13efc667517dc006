"""Export: one ORT-bound FX partition -> an ONNX model, translated node by node with torchlib.

No re-trace through ``torch.export``: the partition's aten nodes already carry fake-tensor
metadata, so each node is dispatched straight to its torchlib function.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from typing import Any

import onnx_ir as ir
import torch
import torch.fx

from .decompositions import size_hint

__all__ = ["export_graph", "onnx_registry", "ExportedGraph", "OutputSlot"]

log = logging.getLogger("ort_dynamo")


def onnx_registry(opset: int):
    """torchlib's aten -> ONNX registry for ``opset``, with ours, and those of other libraries'
    ops defined by now (a library imported after the first compile still gets them)."""
    from . import lowerings

    registry = _built_registry(opset)
    lowerings.register_library_ops(registry)
    return registry


def _empty_ints_attribute(record: logging.LogRecord) -> bool:
    """Drops onnx_ir's "Attribute type is ambiguous because it is an empty sequence" warning:
    torchlib's ``index_put`` makes ``Constant(value_ints=[])`` where no dim is sliced (Mixtral's
    expert routing), and the INTS it defaults to is what was meant. Printed to every user."""
    return "is ambiguous because it is an empty sequence" not in record.getMessage()


@functools.lru_cache(None)
def _built_registry(opset: int):
    """torchlib's registry with our lowerings (built once: it is slow)."""
    from torch.onnx._internal.exporter import _registration

    for name in ("_registration", "_core"):
        logging.getLogger(f"torch.onnx._internal.exporter.{name}").setLevel(logging.ERROR)
    logging.getLogger("onnx_ir._convenience").addFilter(_empty_ints_attribute)
    from . import lowerings

    try:
        registry = _lazy_torchlib_registry(opset)
    except Exception as exc:  # torch's private registry API moved: the slow, public way
        log.debug("lazy torchlib registry unavailable (%s); using from_torchlib", exc)
        registry = _registration.ONNXRegistry.from_torchlib(opset)
    lowerings.register(registry)
    _remember_op_signatures()
    return registry


def _remember_op_signatures() -> None:
    """torch.onnx's op recorder rebuilds an ``OpSignature`` from the ONNX schema on every op
    it emits (about a fifth of export time). A signature depends on the schema alone and is
    only read, so keep one per schema. (Older torch keeps its own ``OpSignature`` class in
    ``_schemas``: both are memoized where present.)"""
    from torch.onnx._internal.exporter import _schemas

    for signature_class in (getattr(getattr(ir, "schemas", None), "OpSignature", None),
                            getattr(_schemas, "OpSignature", None)):
        build = getattr(signature_class, "from_op_schema", None)
        if build is None or getattr(build, "_ort_dynamo_memo", False):
            continue
        signature_class.from_op_schema = staticmethod(_memoized_by_schema(build))


def _memoized_by_schema(build):
    memo: dict = {}

    def from_op_schema(op_schema):
        key = (op_schema.domain, op_schema.name, op_schema.since_version)
        signature = memo.get(key)
        if signature is None:
            signature = memo[key] = build(op_schema)
        return signature

    from_op_schema._ort_dynamo_memo = True
    return from_op_schema


def _lazy_torchlib_registry(opset: int):
    """``ONNXRegistry.from_torchlib`` without its start-up cost (~1.6 s, paid in every
    process's first step): it parses the source of all ~500 torchlib functions to infer
    signatures a model mostly never uses. Same entries, same order, same opset cleanup;
    each op's signatures are inferred the first time dispatch asks for that op."""
    import onnxscript.function_libs.torch_lib.ops  # noqa: F401 (importing registers the functions)
    from onnxscript.function_libs.torch_lib import registration as torchlib
    from torch.onnx._internal.exporter import _registration
    from torch.onnx._internal.exporter._torchlib import _torchlib_registry

    class LazyRegistry(_registration.ONNXRegistry):
        def get_decomps(self, target):
            decomps = super().get_decomps(target)
            for decomp in decomps:
                if decomp.signature is None and getattr(decomp, "_ort_dynamo_lazy", False):
                    decomp._ort_dynamo_lazy = False
                    decomp.skip_signature_inference = False
                    decomp.__post_init__()
            return decomps

        def is_registered(self, target) -> bool:  # no signature inference for a yes/no
            key = target.name() if isinstance(target, torch._ops.OpOverload) else target
            return bool(self.functions.get(key))

    registry = LazyRegistry()
    registry._opset_version = opset
    for meta in _torchlib_registry.get_torchlib_ops():
        registry._register(meta.fx_target, meta)
    for qualified_name, overloads in torchlib.default_registry.items():
        if qualified_name.startswith("internal::"):
            continue
        target = _registration._get_overload(qualified_name)
        if target is None:
            continue
        for function, is_complex in [(f, False) for f in overloads.overloads] + [(f, True) for f in overloads.complex]:
            meta = _registration.OnnxDecompMeta(onnx_function=function, fx_target=target, signature=None,
                                                is_custom=False, is_complex=is_complex,
                                                skip_signature_inference=True)
            meta._ort_dynamo_lazy = True
            registry._register(target, meta)
    registry._cleanup_registry_based_on_opset_version()
    return registry


@dataclasses.dataclass(frozen=True)
class OutputSlot:
    """Where output ``i`` of the FX graph comes from at run time."""

    #: "ort": ONNX output #index; "view": its .view(value); "permute": its .permute(value);
    #: "input": FX input #index; "const": value
    kind: str
    index: int = 0
    value: Any = None


@dataclasses.dataclass
class ExportedGraph:
    #: The ONNX IR, until ``rewrite`` has serialized it (None after: the bytes run).
    model: "ir.Model | None"
    input_names: list[str]
    output_names: list[str]
    #: Per FX output: how to produce it from the ORT outputs.
    slots: list[OutputSlot]
    #: Per ONNX output, the dtype PyTorch expects (ORT's may differ, e.g. bool vs uint8).
    output_dtypes: list[torch.dtype]
    #: Per input: "tensor", or "scalar" for SymInt/int/float inputs passed as 0-d tensors.
    input_kinds: list[str]
    returns_tuple: bool
    #: "cpu" or "cuda": where the graph's tensors live (decides device-specific rewrites).
    device: str = "cpu"
    #: Per input: None, or the dims that make it contiguous: ORT takes ``t.permute(dims)``
    #: without a copy and transposes it back inside the graph (see ``_take_permuted_inputs``).
    input_permutations: list = dataclasses.field(default_factory=list)
    #: C source of each ``ort_dynamo.pointwise`` kernel the model uses (``_pointwise``).
    kernels: list = dataclasses.field(default_factory=list)
    #: The model as it was before those kernels replaced its elementwise chains: it runs
    #: while they compile. In memory only (a cached model's kernels are normally on disk),
    #: and only until a session has loaded the kernels.
    unfused: bytes = b""
    #: Per ONNX output, a key shared by outputs that are one memory in eager (views of one
    #: tensor, each dense over all of it: a saved ``out`` and its heads merged into rows), or
    #: None. Read by ``rewrite``: such outputs may come back as views of one ORT output.
    output_storages: list = dataclasses.field(default_factory=list)
    #: CPU: the session runs on one thread, its work on PyTorch's OpenMP threads (``_openmp``):
    #: the kernels' library of that flavor, torch's BLAS threading each product itself.
    torch_threads: bool = False

    def ort_layout(self, index: int, tensor: torch.Tensor) -> torch.Tensor:
        """Input ``index`` as the ONNX graph takes it: a permuted view (see
        ``_take_permuted_inputs``), or the tensor as it is."""
        order = self.input_permutations[index] if self.input_permutations else None
        return tensor if order is None else tensor.permute(order)


def _output_nodes(gm: torch.fx.GraphModule):
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    args = out.args[0]
    if isinstance(args, (tuple, list)):
        return list(args), True
    return [args], False


_aten = torch.ops.aten
#: Reductions torch defines on bool (summing to int64) whose torchlib lowering feeds the
#: bool straight into ReduceSum, which ONNX rejects.
_BOOL_REDUCTIONS = {_aten.sum.default, _aten.sum.dim_IntList, _aten.cumsum.default}


_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)


def _cast_symbolic_scalars(gm: torch.fx.GraphModule, node: torch.fx.Node) -> None:
    """A SymInt/SymFloat in a Tensor slot (``mul.Tensor(x, s0)``) is promoted by torch as a
    Python number; torchlib sees an int64 tensor. Make it a tensor of the promoted dtype."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return
    tensors = [a.meta["val"] for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
    if not tensors:
        return
    base = tensors[0].dtype
    for arg_schema, arg in zip(schema.arguments, node.args):
        if not (isinstance(arg, torch.fx.Node) and isinstance(arg.meta.get("val"), _SYMBOLIC)):
            continue
        if not isinstance(arg_schema.type, torch.TensorType):
            continue
        sym = arg.meta["val"]
        dtype = torch.get_default_dtype() if isinstance(sym, torch.SymFloat) and not base.is_floating_point \
            else base
        with gm.graph.inserting_before(node):
            cast = gm.graph.call_function(_aten.scalar_tensor.default, (arg,), {"dtype": dtype})
        cast.meta["val"] = torch.empty((), dtype=dtype, device=tensors[0].device)
        node.replace_input_with(arg, cast)


#: Norms PyTorch computes in float32 for a half input (``_norm_in_float32``).
_NORMS_IN_FLOAT32 = {_aten.native_layer_norm.default, _aten.native_group_norm.default}


#: Max/min reductions torch allows on bool; torchlib emits ArgMax/ReduceMax, which reject bool.
_BOOL_MAX_MIN = {_aten.max.dim, _aten.min.dim, _aten.amax.default, _aten.amin.default,
                 _aten.argmax.default, _aten.argmin.default, _aten.max.default, _aten.min.default}


def _norm_in_float32(gm: torch.fx.GraphModule, node: torch.fx.Node) -> None:
    """Run a norm of a half input in float32, as PyTorch's kernels do, and cast its results of
    the input's dtype back: torchlib needs one dtype where autocast gives float32 weights, and
    its LayerNormalization (float32 statistics) in a float16 model gave statistics ORT refused
    as float16 ones."""
    x = node.args[0]
    x_val = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
    if not isinstance(x_val, torch.Tensor) or x_val.dtype not in (torch.bfloat16, torch.float16):
        return
    _compute_in(gm, node, torch.float32)
    for param in node.args[1:]:  # a half model's weight and bias
        if isinstance(param, torch.fx.Node) and getattr(param.meta.get("val"), "dtype", None) == x_val.dtype:
            node.replace_input_with(param, _cast_before(gm, node, param, torch.float32))


def _cast_before(gm: torch.fx.GraphModule, node: torch.fx.Node, value: torch.fx.Node,
                 dtype: torch.dtype) -> torch.fx.Node:
    """A ``_to_copy(value, dtype)`` node placed before ``node``, with its fake-tensor meta."""
    with gm.graph.inserting_before(node):
        cast = gm.graph.call_function(_aten._to_copy.default, (value,), {"dtype": dtype})
    cast.meta["val"] = value.meta["val"].to(dtype)
    return cast


def _compute_in(gm: torch.fx.GraphModule, node: torch.fx.Node, dtype: torch.dtype) -> None:
    """Cast ``node``'s first input to ``dtype`` and its results of that input's dtype back."""
    x = node.args[0]
    x_val = x.meta["val"]
    graph = gm.graph
    node.replace_input_with(x, _cast_before(gm, node, x, dtype))

    def retype(v):
        return v.to(dtype) if isinstance(v, torch.Tensor) and v.dtype == x_val.dtype else v

    val = node.meta["val"]
    outputs = list(node.users) if isinstance(val, (tuple, list)) else [node]
    node.meta["val"] = type(val)(retype(v) for v in val) if isinstance(val, (tuple, list)) else retype(val)
    for out in outputs:
        if out is not node:
            out.meta["val"] = retype(out.meta["val"])
        want = out.meta["val"]
        if not isinstance(want, torch.Tensor) or want.dtype != dtype:
            continue
        with graph.inserting_after(out):
            down = graph.call_function(_aten._to_copy.default, (out,), {"dtype": x_val.dtype})
        down.meta["val"] = want.to(x_val.dtype)
        out.replace_all_uses_with(down, delete_user_cb=lambda n, d=down: n is not d)


#: Ops taking a list of index tensors: torch accepts int32 indices, ONNX's
#: GatherND/ScatterND only int64.
_INDEXING = {_aten.index.Tensor, _aten._unsafe_index.Tensor, _aten.index_put.default,
             _aten._unsafe_index_put.default}


def _widen_int32_indices(gm: torch.fx.GraphModule, node: torch.fx.Node) -> None:
    indices = node.args[1]
    if not isinstance(indices, (list, tuple)):
        return
    widened = []
    for index in indices:
        val = index.meta.get("val") if isinstance(index, torch.fx.Node) else None
        if isinstance(val, torch.Tensor) and val.dtype == torch.int32:
            index = _cast_before(gm, node, index, torch.int64)
        widened.append(index)
    node.args = (node.args[0], type(indices)(widened), *node.args[2:])


def _is_empty(val) -> bool:
    """A tensor with a static zero-size dim (a symbolic size is never 0: torch specializes it)."""
    return isinstance(val, torch.Tensor) and any(isinstance(d, int) and d == 0 for d in val.shape)


#: Reductions whose value over no elements ORT gets wrong: averages are NaN in torch (ORT's
#: ReduceMean of nothing is 0), ``any`` is False (torchlib's lowering gives True).
_VALUE_OF_NOTHING = {_aten.mean: float("nan"), _aten.var: float("nan"), _aten.std: float("nan"),
                     torch.ops.prims.var: float("nan"), _aten.any: False, _aten.all: True}


def _value_of_nothing(node: torch.fx.Node):
    """The fill value of a reduction of an empty input to a non-empty result (None if not one)."""
    source = node.args[0] if node.args else None
    if not (isinstance(source, torch.fx.Node) and _is_empty(source.meta.get("val"))):
        return None
    return _VALUE_OF_NOTHING.get(getattr(node.target, "overloadpacket", None))


def _empty_results_as_zeros(gm: torch.fx.GraphModule) -> None:
    """An empty result has no values, only a shape and dtype: make it ``zeros`` of that shape
    (and a reduction over nothing its value, as torch's).
    ORT mishandles empty tensors in ways torchlib does not guard against (Reshape to a shape
    with -1, reductions with negative axes keeping their axis), and some lowerings return the
    wrong shape (batch norm's saved statistics, empty in eval mode)."""
    graph = gm.graph
    replaced = False
    for node in list(graph.nodes):
        val = node.meta.get("val")
        if (node.op != "call_function" or node.target in (_aten.zeros.default, _aten.full.default)
                or not node.users or not isinstance(val, torch.Tensor)
                or not all(isinstance(d, int) for d in val.shape)):
            continue
        schema = getattr(node.target, "_schema", None)
        if schema is not None and schema.is_mutable:
            continue
        fill = 0 if _is_empty(val) else _value_of_nothing(node)
        if fill is None:
            continue
        with graph.inserting_before(node):
            const = graph.call_function(_aten.full.default, (list(val.shape), fill),
                                        {"dtype": val.dtype, "device": val.device})
        const.meta.update(node.meta)
        node.replace_all_uses_with(const)
        replaced = True
    if replaced:
        graph.eliminate_dead_code()


def _wrap_reduction_dims(node: torch.fx.Node) -> None:
    """Negative ``dim`` of a reduction (an op with ``dim`` and ``keepdim``) -> non-negative:
    ORT ignores a negative reduction axis on an empty input (see rewrite's
    ``_normalize_reduce_axes``), and torchlib's axes are rarely constant before folding."""
    schema = getattr(node.target, "_schema", None)
    source = node.args[0] if node.args else None
    val = source.meta.get("val") if isinstance(source, torch.fx.Node) else None
    if schema is None or not isinstance(val, torch.Tensor) or val.dim() == 0:
        return
    names = [a.name for a in schema.arguments]
    if "dim" not in names or "keepdim" not in names:
        return
    index = names.index("dim")
    in_args = index < len(node.args)
    dim = node.args[index] if in_args else node.kwargs.get("dim")
    rank = val.dim()
    if isinstance(dim, int) and dim < 0:
        dim = dim % rank
    elif isinstance(dim, (list, tuple)) and any(isinstance(d, int) and d < 0 for d in dim):
        dim = type(dim)(d % rank if isinstance(d, int) else d for d in dim)
    else:
        return
    if in_args:
        node.args = (*node.args[:index], dim, *node.args[index + 1:])
    else:
        node.kwargs = {**node.kwargs, "dim": dim}


def _fill_required_defaults(node: torch.fx.Node, registry) -> None:
    """FX drops arguments left at their schema default (``amin(x)`` for ``amin(x, dim=[])``);
    pass those that torchlib's function declares required."""
    schema = getattr(node.target, "_schema", None)
    if schema is None or not registry.is_registered(node.target):
        return
    required = {param.name for decomp in registry.get_decomps(node.target) if decomp.signature is not None
                for param in decomp.signature.params if getattr(param, "required", False)}
    for index, argument in enumerate(schema.arguments):
        if (argument.name in required and index >= len(node.args) and argument.name not in node.kwargs
                and argument.has_default_value() and argument.default_value is not None):
            node.kwargs = {**node.kwargs, argument.name: argument.default_value}


def _fix_for_torchlib(gm: torch.fx.GraphModule, registry=None) -> None:
    """Insert the dtype casts torch does implicitly and torchlib omits.

    Mixed-dtype elementwise ops (``mul(float, int64)``, ``where(c, float, double)``) get
    explicit casts from torch.onnx's own type-promotion pass; ONNX Mul/Add/... need one type.
    Complex results are refused: torchlib represents them as (..., 2) real pairs, which
    would come back to PyTorch with the wrong shape and dtype.
    """
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        vals = val if isinstance(val, (tuple, list)) else [val]
        if node.op == "call_function" and any(isinstance(v, torch.Tensor) and v.is_complex() for v in vals):
            raise TypeError(f"{node.target} returns a complex tensor; ORT partitions support real dtypes only")
    _empty_results_as_zeros(gm)
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and registry is not None:
            _fill_required_defaults(node, registry)
        if node.op == "call_function":
            _wrap_reduction_dims(node)
        if node.op == "call_function" and node.target in _NORMS_IN_FLOAT32:
            _norm_in_float32(gm, node)
        elif node.op == "call_function" and node.target in _BOOL_MAX_MIN:
            source = node.args[0]
            if isinstance(source, torch.fx.Node) and getattr(source.meta.get("val"), "dtype", None) == torch.bool:
                _compute_in(gm, node, torch.int32)
    _insert_type_promotion(gm)
    for node in list(gm.graph.nodes):
        if node.op == "call_function":
            _cast_symbolic_scalars(gm, node)
            if node.target in _INDEXING:
                _widen_int32_indices(gm, node)
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _BOOL_REDUCTIONS:
            continue
        source = node.args[0]
        val = source.meta.get("val") if isinstance(source, torch.fx.Node) else None
        out = node.meta.get("val")
        if isinstance(val, torch.Tensor) and val.dtype == torch.bool and isinstance(out, torch.Tensor):
            node.replace_input_with(source, _cast_before(gm, node, source, out.dtype))
    gm.recompile()


def _insert_type_promotion(gm: torch.fx.GraphModule) -> None:
    """torch.onnx's type-promotion pass, without re-running every node on fake tensors (a
    quarter of export time): a node the pass leaves as it is keeps the value AOTAutograd
    traced for it; the nodes it changes or adds are run, as the pass itself does."""
    from torch.onnx._internal.fx import passes as onnx_fx_passes
    from torch.onnx._internal.fx.passes import type_promotion

    promote = onnx_fx_passes.InsertTypePromotion(gm)
    base = getattr(type_promotion, "_TypePromotionInterpreter", None)
    rule_of = getattr(type_promotion, "get_type_promotion_rule", None)
    if base is None or rule_of is None or not isinstance(promote.interpreter, base):
        promote.run()  # torch's private pass changed shape: run it as it is
        return

    class KnownValues(base):
        def run_node(self, node):
            known = node.meta.get("val")
            if node.op != "call_function" or known is None:
                return super().run_node(node)
            args, kwargs = node.args, node.kwargs
            with self._set_current_node(node):
                if rule := rule_of(node, self.type_promotion_table):
                    self._maybe_promote_node(node, rule)
            if node.args is args and node.kwargs is kwargs:
                return known
            return torch.fx.Interpreter.run_node(self, node)

    promote.interpreter = KnownValues(gm, promote.interpreter.type_promotion_table)
    promote.run()


def export_graph(gm: torch.fx.GraphModule, opset: int = 18) -> ExportedGraph:
    """Translate ``gm`` (aten ops with ``meta['val']``) into an ONNX model."""
    from torch.onnx._internal.exporter import _core, _ir_passes

    registry = onnx_registry(opset)
    _fix_for_torchlib(gm, registry)
    model = ir.Model(ir.Graph([], [], nodes=[], name="ort_dynamo_graph"),
                     ir_version=10, producer_name="ort_dynamo")
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node in placeholders:
        if "val" not in node.meta:
            raise ValueError(f"input {node.name!r} has no shape/dtype metadata")
    values = _core._translate_fx_graph(gm.graph, model, graph_like=model.graph, owned_graphs={},
                                       lower="at_conversion", registry=registry)

    # Outputs: ONNX wants each value once and never a graph input; the rest is rebuilt in Python.
    model.graph.outputs.clear()
    input_index = {n.name: i for i, n in enumerate(placeholders)}
    fx_outputs, returns_tuple = _output_nodes(gm)
    slots, output_dtypes, output_storages = [], [], []
    ort_slots: dict[str, OutputSlot] = {}  # FX output name -> its ONNX output, made once
    for out in fx_outputs:
        if out is None or not isinstance(out, torch.fx.Node):
            slots.append(OutputSlot("const", value=out))
        elif out.name in input_index:
            slots.append(OutputSlot("input", input_index[out.name]))
        elif not isinstance(out.meta.get("val"), torch.Tensor):
            raise TypeError(f"graph output {out.name!r} is not a tensor ({type(out.meta.get('val'))})")
        else:
            if out.name not in ort_slots:
                index = len(model.graph.outputs)
                value = values[out.name]
                order = _contiguous_order(out.meta["val"])
                if order is not None:
                    value = _buffer_layout(model.graph, value, order, out.name)
                elif value.is_graph_input() or value in model.graph.outputs:
                    # A lowering that returns its input unchanged: ORT would hand back the
                    # input's (possibly freed) buffer. An Identity gives a fresh result.
                    copy = ir.node("Identity", [value])
                    copy.outputs[0].name = out.name + "_copy"
                    copy.outputs[0].dtype, copy.outputs[0].shape = value.dtype, value.shape
                    model.graph.append(copy)
                    value = copy.outputs[0]
                model.graph.outputs.append(value)
                output_dtypes.append(out.meta["val"].dtype)
                output_storages.append(_whole_storage(out.meta["val"]))
                ort_slots[out.name] = (OutputSlot("ort", index) if order is None else
                                       OutputSlot("permute", index, _inverse(order)))
            slots.append(ort_slots[out.name])

    permutations = _take_permuted_inputs(model.graph, [_contiguous_order(n.meta["val"]) for n in placeholders])
    _ir_passes.add_opset_imports(model)
    model.opset_imports[""] = opset
    input_kinds = ["tensor" if isinstance(n.meta["val"], torch.Tensor) else "scalar" for n in placeholders]
    devices = {n.meta["val"].device.type for n in placeholders if isinstance(n.meta["val"], torch.Tensor)}
    return ExportedGraph(
        model=model,
        input_names=[v.name for v in model.graph.inputs],
        output_names=[v.name for v in model.graph.outputs],
        slots=slots,
        output_dtypes=output_dtypes,
        input_kinds=input_kinds,
        returns_tuple=returns_tuple,
        device="cuda" if "cuda" in devices else "cpu",
        input_permutations=permutations,
        output_storages=output_storages,
    )


def _whole_storage(val) -> tuple | None:
    """(storage, offset, size, dtype) of a fake tensor laid densely over its elements (contiguous or a
    permutation of contiguous), static sizes only; else None. Two outputs with one key are one
    memory in eager."""
    from torch.multiprocessing.reductions import StorageWeakRef

    try:
        numel = val.numel()
        if not isinstance(numel, int) or numel < 2 or not all(isinstance(d, int) for d in (*val.shape, *val.stride())):
            return None
        if not val.is_contiguous() and _dense_permutation(val.shape, val.stride()) is None:
            return None
        return StorageWeakRef(val.untyped_storage()), val.storage_offset(), numel, val.dtype
    except (RuntimeError, NotImplementedError, TypeError):  # no storage to name (a functional wrapper)
        return None


def _contiguous_order(val) -> list[int] | None:
    """The dims of a transposed/permuted view that make it contiguous (None if it already is,
    or if it is not a dense permutation, e.g. expanded or sliced). Symbolic sizes and strides
    are judged by the values they were traced with: the order is the strides' for every size
    Dynamo's guards admit (sizes 0 and 1 are specialized), and where a stride only matched at
    those values the output would still hold eager's values, by other strides."""
    if not isinstance(val, torch.Tensor) or val.is_contiguous() or val.numel() < 2:
        return None
    sizes, strides = ([size_hint(d, unbacked=None) for d in dims] for dims in (val.shape, val.stride()))
    if None in sizes or None in strides:
        return None
    return _dense_permutation(sizes, strides)


def _dense_permutation(sizes, strides) -> list[int] | None:
    """The dims from outermost to innermost in memory, where the layout is dense (a
    permutation of a contiguous tensor); None otherwise (expanded, sliced)."""
    order = sorted(range(len(sizes)), key=lambda d: (-strides[d], d))
    return order if _is_dense(sizes, strides, order) else None


def _is_dense(sizes, strides, order) -> bool:
    """Whether a layout is the contiguous one of the dims taken in ``order`` (outermost first;
    a dim of size 1 may have any stride)."""
    step = 1
    for d in reversed(order):
        if sizes[d] != 1 and strides[d] != step:
            return False
        step *= sizes[d]
    return True


def _inverse(order: list[int]) -> tuple[int, ...]:
    return tuple(order.index(d) for d in range(len(order)))


def _buffer_layout(graph: "ir.Graph", value: "ir.Value", order: list[int], name: str) -> "ir.Value":
    """A graph output that PyTorch has as a permuted view (a saved ``k.transpose(-2, -1)``):
    ORT returns the tensor in its buffer's layout, ``Transpose(value, order)``, and run.py
    permutes it back, a free view with eager's strides. The backward then takes that buffer
    as it is (``_take_permuted_inputs``) instead of copying a contiguous tensor into it. Where
    ``value`` is itself a Transpose, ORT cancels the pair: no pass at all."""
    buffer = ir.node("Transpose", [value], attributes={"perm": list(order)})
    buffer.outputs[0].name = name + "_buffer"
    buffer.outputs[0].dtype = value.dtype
    if value.shape is not None:
        buffer.outputs[0].shape = ir.Shape([value.shape[d] for d in order])
    graph.append(buffer)
    return buffer.outputs[0]


def _take_permuted_inputs(graph: "ir.Graph", permutations: list) -> list:
    """Saved activations arrive as views (``weight.t()``, transposed attention heads). Instead
    of copying each into a contiguous tensor per call, ORT takes the underlying contiguous
    layout (``t.permute(order)``, see run.py) and a Transpose at the top of the graph restores
    the logical tensor; ORT folds such a Transpose into its MatMul/Gemm. Done on the ONNX
    graph: the FX graph stays the PyTorch fallback, with its own calling convention."""
    first = next(iter(graph), None)
    applied = []
    for index, order in enumerate(permutations):
        logical = graph.inputs[index]
        if order is None or first is None or not logical.uses():
            applied.append(None)
            continue
        dims = list(logical.shape.dims)
        contiguous = ir.Value(name=logical.name, type=logical.type, shape=ir.Shape([dims[d] for d in order]))
        logical.name = f"{contiguous.name}_replaced"
        restore = ir.node("Transpose", [contiguous], attributes={"perm": list(_inverse(order))})
        graph.insert_before(first, restore)
        logical.replace_all_uses_with(restore.outputs[0])
        restore.outputs[0].name = f"{contiguous.name}_logical"
        restore.outputs[0].dtype, restore.outputs[0].shape = logical.dtype, logical.shape
        graph.inputs[index] = contiguous
        applied.append(order)
    return applied


def save_debug_files(exported: ExportedGraph, gm, model_bytes: bytes, options, stem: str) -> str:
    """``save_onnx``: write ``<prefix>_<stem>.onnx`` (as ORT runs it, after rewrite) and the FX
    graph it came from; returns the ONNX path. A model with pointwise kernels needs their
    library to load: it is written beside it as ``.pointwise.so``, which
    ``SessionOptions.register_custom_ops_library(path)`` registers, with the kernels' C source
    (``.pointwise.c``, to read; ``.pointwise.cu`` for CUDA's)."""
    base = os.path.join(options.save_path, f"{options.onnx_prefix}_{stem}")
    os.makedirs(os.path.dirname(base) or ".", exist_ok=True)  # a prefix may name a subfolder
    with open(base + ".onnx", "wb") as fh:
        fh.write(model_bytes)
    if exported.kernels:
        import shutil

        from . import _kernels, _pointwise

        if all(_pointwise.is_cuda(k) for k in exported.kernels):  # CUDA C, and the host side's table
            with open(base + ".pointwise.cu", "w") as fh:
                fh.write("\n".join([*exported.kernels, "/* the host library's table:",
                                    _pointwise.cuda_table_source(exported.kernels), "*/"]))
        else:
            with open(base + ".pointwise.c", "w") as fh:
                fh.write("\n".join([*exported.kernels, _pointwise.table_source(exported.kernels)]))
        try:
            shutil.copyfile(_kernels.library(exported.kernels, options.cache_dir, exported.torch_threads),
                            base + ".pointwise.so")
        except _kernels.KernelBuildError as exc:  # the partition runs without them (run.py warns)
            log.warning("ort_dynamo: %s.pointwise.so not written: %s", base, str(exc)[:300])
    with open(base + ".fx.txt", "w") as fh:
        fh.write(gm.print_readable(print_output=False))
    return base + ".onnx"
