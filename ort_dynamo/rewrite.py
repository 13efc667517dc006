"""Rewrite: ONNX model -> what ORT runs best on the target device."""

from __future__ import annotations

import logging
import math

import numpy as np
import onnx_ir as ir

from . import _fusions, _kernels, _op_kernels, _openmp, _pointwise, _torch_blas
from .export import ExportedGraph, OutputSlot
from .options import OrtOptions

__all__ = ["rewrite", "own_products_apply", "pointwise_kernels_apply"]

log = logging.getLogger("ort_dynamo")

# Constant folding turns values into initializers that are also graph outputs; the dedup
# pass then logs a warning per value, which is noise for us.
logging.getLogger("onnx_ir.passes.common.initializer_deduplication").setLevel(logging.ERROR)

#: Ops whose ORT CPU kernels take bfloat16 (probed on onnxruntime 1.31: Expand, Tile, Where
#: and Size do not), plus ops whose output type is an attribute (Constant, ConstantOfShape,
#: Cast): these stay as they are; every other op touching bf16 is computed in fp32.
_BF16_OK_ON_CPU = {
    "Cast", "CastLike", "Identity", "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Concat",
    "Slice", "Gather", "GatherElements", "GatherND", "Flatten", "Shape", "Split", "Constant",
    "ConstantOfShape", "ScatterND", "ScatterElements",
}


#: Ops that move values without computing new ones, so their results have their first input's
#: type (what ``_compute_bfloat16_in_float32`` needs to know of values inlined from a lowering,
#: which carry none). Not arithmetic: inside a lowering (torchlib's GELU) eager rounds only the
#: op's result, so intermediate values must stay float32, untyped.
_TYPE_OF_FIRST_INPUT = {
    "Pad", "Slice", "Reshape", "Transpose", "Concat", "Split", "Expand", "Tile", "Squeeze", "Unsqueeze",
    "Identity", "Flatten", "Gather", "GatherElements", "GatherND",
}


def _on_torch_threads(exported: ExportedGraph, model: ir.Model, options: OrtOptions) -> None:
    """Decide whether the graph's session runs on PyTorch's OpenMP threads (``_openmp``); if so,
    its products on torch's BLAS are threaded by the BLAS itself there."""
    if exported.device != "cpu":
        return
    nodes = [*model.graph, *(node for function in model.functions.values() for node in function)]
    exported.torch_threads = _openmp.applies(options, exported.device,
                                             _openmp.threaded_ort_share(nodes, _torch_blas.DOMAIN),
                                             pointwise_kernels_apply(options, exported.device))
    if exported.torch_threads:
        for node in nodes:
            if node.domain == _torch_blas.DOMAIN:
                node.attributes["torch_threads"] = ir.AttrInt64("torch_threads", 1)


def pointwise_kernels_apply(options: OrtOptions, device: str) -> bool:
    """Whether a graph on ``device`` ("cpu", "cuda") gets generated kernels for its elementwise
    chains: asked here, and, for the CPU, before tracing, where it picks a few decompositions
    the C kernels fuse (the CUDA ones take no column sums)."""
    if not (options.pointwise_kernels and options.enable_compute_optimizer and not options.deterministic_compute):
        return False
    return _kernels.available() if device == "cpu" else device == "cuda" and _kernels.cuda_available()


def own_products_apply(options: OrtOptions, device: str) -> bool:
    """Whether a graph on ``device`` gets ort_dynamo's own float32 products (csrc/bf16_gemm.h: CPU
    kernels, a compiler targeting AVX-512): asked before tracing too, where it keeps a
    convolution's weight gradient one Conv for csrc/conv_weight_grad.h."""
    return device == "cpu" and pointwise_kernels_apply(options, device) and _kernels.float32_products()


def rewrite(exported: ExportedGraph, options: OrtOptions) -> bytes:
    """Rewrite ``exported.model`` in place for ``exported.device``; return serialized bytes."""
    model = exported.model
    try:
        ir.passes.common.InlinePass()(model)
    except ValueError as exc:
        # torchlib functions are written against opset 18; inlining them into a model of a
        # newer opset is refused. ORT runs model-local functions itself, so keep them.
        if "Opset mismatch" not in str(exc):
            raise
    _normalize_reduce_axes(model.graph)
    _indices_as_int64(model.graph)
    if exported.device == "cpu":
        _compute_bfloat16_in_float32(model.graph)
        _float16_gaps_in_float32(model.graph)
        _sigmoid_from_exp(model.graph)
    _propagate_nan_through_min_max(model.graph)
    _sort_nan_as_largest(model.graph)
    optimize = options.enable_compute_optimizer and not options.deterministic_compute
    if optimize:
        import onnxscript.optimizer

        # Constant folding (shape arithmetic torchlib emits) and dead-code removal. Not the
        # onnxscript pattern rewriter: ORT's own graph optimizer covers it at a tenth the time.
        onnxscript.optimizer.fold_constants(model, onnx_shape_inference=False)
        _normalize_reduce_axes(model.graph)  # axes that were only constant after folding
        if exported.device == "cpu":
            # Chains ORT's optimizer misses -> its fused CPU kernels (Gelu, FastGelu, RMSNorm).
            _fusions.fuse(model)
    if exported.device == "cuda":
        _integer_pads_as_concat(model.graph)
    if _torch_blas.applies(options, exported.device) and _op_kernels.blas_products(
            model.graph, _torch_blas.DOMAIN, _torch_blas.bfloat16_products()):
        model.opset_imports[_torch_blas.DOMAIN] = 1
    _on_torch_threads(exported, model, options)
    _reshaped_outputs_as_views(exported)
    if not options.save_onnx:
        _drop_provenance(model)
    ir.passes.common.RemoveUnusedNodesPass()(model)  # what the passes above left dead
    ir.passes.common.RemoveUnusedFunctionsPass()(model)
    if pointwise_kernels_apply(options, exported.device):
        # Last, so that the model without the kernels (run while they compile) is the same
        # model in every other respect: same inputs, outputs and names.
        unfused = ir.serde.serialize_model(model).SerializeToString()
        try:
            exported.kernels = _pointwise.fuse_pointwise(model, _kernels.bfloat16_products, exported.device,
                                                         own_attention=not options.cpu_torch_attention,
                                                         float32_products=_kernels.float32_products)
        except Exception as exc:  # an optimization: its failure must not cost the partition
            log.warning("ort_dynamo: no pointwise kernels for this partition, the fusion pass failed: %s: %s",
                        type(exc).__name__, exc)
            exported.kernels = []
            return unfused
        if exported.kernels:
            exported.unfused = unfused
            ir.passes.common.RemoveUnusedNodesPass()(model)  # constants that became C literals
    if optimize:
        # After the kernels, whose passes match Transposes by their perm. On CUDA only where a
        # Reshape replaces the Transpose: more nodes cost host time there (not measured).
        _op_kernels.transposes_without_unit_axes(model.graph, add_nodes=exported.device == "cpu")
        if _index_runs_as_slices(model.graph):  # after the kernels: pooling's match Gathers by their tables
            ir.passes.common.RemoveUnusedNodesPass()(model)  # the indices
        if exported.device == "cpu":  # ORT's CPU broadcasting only (its CUDA kernels: not measured)
            _op_kernels.one_element_operands_at_full_rank(model.graph)
            ir.passes.common.RemoveUnusedNodesPass()(model)  # the Constants replaced
        # Last: the kernel passes above match Reshapes as the exporter wrote them.
        if _collapse_reshape_chains(model.graph) + _collapse_unsqueeze_chains(model.graph):
            ir.passes.common.RemoveUnusedNodesPass()(model)
    return ir.serde.serialize_model(model).SerializeToString()


def _collapse_reshape_chains(graph: ir.Graph) -> int:
    """``Reshape(Reshape(x, a), b)`` -> ``Reshape(x, b)``, and a Reshape to its input's own
    static shape (``b`` itself, no -1) -> its input. AOTAutograd writes a view before and after
    each product, so a product's result is often reshaped to [B, S, N] only to be reshaped back
    to [B*S, N] for the next one. Each Reshape is a node ORT dispatches: little on CPU, about
    13 µs of host time each on CUDA, where the step is the host's (docs/performance-log.md, GPU).
    Only where ``b`` is a constant with no 0 (without ``allowzero`` a 0 copies a dimension of
    the inner Reshape's result, not of x) and neither Reshape's result is a graph output (those
    are the outputs PyTorch takes as views). Returns how many Reshapes went."""
    count = 0
    for node in list(graph):
        if node.graph is None or not _fusions._op(node, "Reshape") or len(node.inputs) < 2:
            continue
        shape = _fusions._ints(node.inputs[1])
        result = node.outputs[0]
        if shape is None or result.is_graph_output():
            continue
        source = node.inputs[0]
        inner = source.producer() if source is not None else None
        copies_dims = 0 in shape and not node.attributes.get_int("allowzero", 0)
        if _fusions._op(inner, "Reshape") and not copies_dims and not source.is_graph_output():
            node.replace_input_with(0, inner.inputs[0])
            if not source.uses():
                graph.remove(inner, safe=True)
                count += 1
            source = node.inputs[0]
        if source is not None and _static(source.shape) and list(source.shape.dims) == shape:
            result.replace_all_uses_with(source)
            graph.remove(node, safe=True)
            count += 1
    return count


def _collapse_unsqueeze_chains(graph: ir.Graph) -> int:
    """``Unsqueeze(Unsqueeze(x, a), b)`` -> ``Unsqueeze(x, a')``, and ``Unsqueeze(Squeeze(x, a),
    a)`` -> ``x``. Batch norm's decompositions broadcast each per-channel vector to [C, 1, 1] or
    [1, C, 1, 1] one axis at a time, and its backward squeezes a [1, C, 1, 1] statistic to [C]
    only to unsqueeze it back: ResNet's backward had 291 Unsqueezes, each a node ORT dispatches.
    Rank arithmetic only, so symbolic shapes are fine; axes must be constants. Not where the
    inner result or the outer result is a graph output. Returns how many steps it took (0: the
    graph is as it was)."""
    count = 0
    for node in list(graph):
        while node.graph is not None and _fusions._op(node, "Unsqueeze"):
            went = _unsqueeze_of_a_view(graph, node)
            if not went:
                break
            count += went
    return count


def _unsqueeze_of_a_view(graph: ir.Graph, node: ir.Node) -> int:
    """One step of ``_collapse_unsqueeze_chains`` at ``node``: 0 if it changed nothing, else 1
    plus the inner node if that went too."""
    if len(node.inputs) != 2:
        return 0
    source, result = node.inputs[0], node.outputs[0]
    inner = source.producer() if source is not None else None
    axes = _fusions._ints(node.inputs[1])
    rank = result.shape.rank() if result.shape is not None else None
    if (axes is None or rank is None or result.is_graph_output() or source.is_graph_output() or inner is None
            or len(inner.inputs) != 2 or not (_fusions._op(inner, "Unsqueeze") or _fusions._op(inner, "Squeeze"))):
        return 0
    inner_axes = _fusions._ints(inner.inputs[1])
    if inner_axes is None:
        return 0
    axes = sorted(a % rank for a in axes)
    if _fusions._op(inner, "Squeeze"):
        # Squeeze's axes count in its input's rank, which is the result's when they cancel.
        if sorted(a % rank for a in inner_axes) != axes:
            return 0
        result.replace_all_uses_with(inner.inputs[0])
        graph.remove(node, safe=True)
    else:
        # The inner result's axes, in order, fill the positions the outer Unsqueeze leaves.
        kept = [p for p in range(rank) if p not in axes]
        composed = sorted(axes + [kept[a % len(kept)] for a in inner_axes])
        node.replace_input_with(0, inner.inputs[0])
        # Each step at a node adds axes, so the name is new: one constant per step.
        name = f"{result.name}_axes_{'_'.join(map(str, composed))}"
        node.replace_input_with(1, _fusions._int64_constant(graph, name, composed))
    went = 1
    if not source.uses():
        graph.remove(inner, safe=True)
        went += 1
    return went


def _drop_provenance(model: "ir.Model") -> None:
    """The exporter notes on every node where it came from (stack trace, module path, FX
    node): most of a model's bytes, and ORT keeps its own copy for the session's life (BERT:
    3.3 MB less live, ``benchmarks/memory_phases.py --live``). Kept only where a person reads
    the model (``save_onnx``)."""
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        node.metadata_props.clear()
    for function in model.functions.values():
        for node in ir.traversal.RecursiveGraphIterator(function):
            node.metadata_props.clear()


def _reshaped_outputs_as_views(exported: ExportedGraph) -> None:
    """A Reshape whose result is a graph output makes ORT copy (it cannot hand out an alias of
    an internal buffer). Output the Reshape's input instead and let PyTorch take a free
    ``.view(shape)``: saved activations are often such reshapes. Only for static shapes, and
    only where nothing else returns that buffer, so outputs alias exactly as before."""
    graph = exported.model.graph
    claimed = set()
    for index, out in enumerate(list(graph.outputs)):
        node = out.producer()
        if node is None or node.op_type != "Reshape" or node.domain not in ("", "ai.onnx"):
            continue
        source = node.inputs[0]
        if (source is None or source in claimed or source.is_graph_input() or source.is_graph_output()
                or not _static(out.shape) or not _static(source.shape)
                or math.prod(out.shape.dims) != math.prod(source.shape.dims)):
            continue  # a source that is an output itself: _outputs_of_one_memory_as_views
        claimed.add(source)
        graph.outputs[index] = source
        exported.output_names[index] = source.name
        exported.slots = [OutputSlot("view", slot.index, tuple(out.shape.dims))
                          if slot.kind == "ort" and slot.index == index else slot for slot in exported.slots]
    _outputs_of_one_memory_as_views(exported)


def _outputs_of_one_memory_as_views(exported: ExportedGraph) -> None:
    """Graph outputs that eager has as one memory (``ExportedGraph.output_storages``: views of
    one tensor, each dense over all of it, such as attention's saved output and its heads merged
    into rows for the projection after it): one stays an ORT output, the others come back as
    views of it, one buffer as in eager where ORT would make each its own. Each ORT output of
    such a group holds the memory in its order (a contiguous value, a permuted view's buffer, a
    view's source), so a view of one is the bytes of another. One that PyTorch permutes is the
    one kept (a view of a view cannot be permuted back); two such stay."""
    graph, keys = exported.model.graph, exported.output_storages
    if len(keys) != len(graph.outputs):
        return
    groups: dict = {}
    for i, key in enumerate(keys):
        if key is not None:
            groups.setdefault(key, []).append(i)
    kinds = {i: {slot.kind for slot in exported.slots if slot.kind in ("ort", "view", "permute") and slot.index == i}
             for members in groups.values() for i in members}
    dropped: dict[int, int] = {}  # output -> the output it becomes a view of
    for members in groups.values():
        permuted = [i for i in members if "permute" in kinds[i]]
        keep = permuted[0] if permuted else members[0]
        for i in members:
            if i != keep and "permute" not in kinds[i] and _static(graph.outputs[i].shape):
                dropped[i] = keep
    if not dropped:
        return

    def moved(i: int) -> int:
        return i - sum(d < i for d in dropped)

    slots = []
    for slot in exported.slots:
        if slot.kind in ("ort", "view") and slot.index in dropped:
            shape = slot.value if slot.kind == "view" else tuple(graph.outputs[slot.index].shape.dims)
            slots.append(OutputSlot("view", moved(dropped[slot.index]), tuple(shape)))
        elif slot.kind in ("ort", "view", "permute"):
            slots.append(OutputSlot(slot.kind, moved(slot.index), slot.value))
        else:
            slots.append(slot)
    for i in sorted(dropped, reverse=True):
        del graph.outputs[i], exported.output_names[i], exported.output_dtypes[i], keys[i]
    exported.slots = slots


_REDUCE_OPS = {"ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
               "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare"}


def _normalize_reduce_axes(graph: ir.Graph) -> None:
    """ORT 1.31 ignores a negative reduction axis when the input is empty: ReduceSum over
    axis -1 of a (3, 0) tensor returns it unchanged instead of zeros of shape (3,). Make the
    axes non-negative wherever they are constant and the input's rank is known (export's
    ``_wrap_reduction_dims`` does so for aten's ``dim`` arguments already)."""
    for node in list(graph):
        if node.op_type not in _REDUCE_OPS or node.domain not in ("", "ai.onnx") or len(node.inputs) < 2:
            continue
        data, axes = node.inputs[0], node.inputs[1]
        if data is None or axes is None or data.shape is None:
            continue
        tensor = ir.convenience.get_const_tensor(axes)
        if tensor is None:
            continue
        values = [int(a) for a in tensor.numpy().reshape(-1)]
        if all(a >= 0 for a in values):
            continue
        rank = len(data.shape)
        fixed = ir.node("Constant", [], attributes={"value": ir.tensor([a % rank for a in values], dtype=ir.DataType.INT64)})
        fixed.outputs[0].dtype, fixed.outputs[0].shape = ir.DataType.INT64, ir.Shape([len(values)])
        graph.insert_before(node, fixed)
        node.replace_input_with(1, fixed.outputs[0])


def _index_runs_as_slices(graph: ir.Graph) -> int:
    """A Gather whose indices are a constant run ``s, s+1, ..., s+n-1`` inside the axis (XLNet's
    ``index_select(x, 3, arange(klen))`` after its relative shift) -> a Slice: ORT gathers
    element by element (0.5 ms for XLNet's [4, 4, 64, 64] on Zen 3) where a Slice copies rows.
    Only where the axis's length is known: a Slice clamps what a Gather would refuse. Returns
    the count."""
    count = 0
    for node in list(graph):
        if not _fusions._op(node, "Gather") or len(node.inputs) != 2:
            continue
        data, indices = node.inputs
        tensor = ir.convenience.get_const_tensor(indices) if indices is not None else None
        if tensor is None or data is None or data.shape is None or len(tensor.shape) != 1 or tensor.shape[0] == 0:
            continue
        axis = node.attributes.get_int("axis", 0)
        axis = axis + len(data.shape) if axis < 0 else axis
        values = tensor.numpy().astype(np.int64)
        length = data.shape[axis] if 0 <= axis < len(data.shape) else None
        if not isinstance(length, int) or values[0] < 0 or values[-1] >= length \
                or not np.array_equal(values, np.arange(values[0], values[0] + len(values))):
            continue
        bounds = [_fusions._int64_constant(graph, f"{node.outputs[0].name}_{what}", [int(value)])
                  for what, value in (("starts", values[0]), ("ends", values[-1] + 1), ("axes", axis))]
        sliced = ir.node("Slice", [data, *bounds])
        sliced.metadata_props.update(node.metadata_props)
        graph.insert_before(node, sliced)
        _fusions._take_over(node.outputs[0], sliced.outputs[0], "gathered")
        graph.remove(node, safe=True)
        count += 1
    return count


_FLOAT_TYPES = {ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.FLOAT16, ir.DataType.BFLOAT16}


#: Ops whose output has their first input's element type: ``x.argmin()`` reduces an untyped
#: Reshape of ``x`` to one dim.
_SAME_DTYPE = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Transpose", "Identity", "Expand"})


def _propagate_nan_through_min_max(graph: ir.Graph) -> None:
    """ORT's ReduceMax/ReduceMin and ArgMax/ArgMin pass over NaN (onnxruntime 1.31: the amax
    of a row holding a NaN is finite); torch's max/min/amax/amin return NaN there, and
    argmax/argmin the index of the first NaN. Where a float reduction saw a NaN, its result
    becomes that: one more reduction, of IsNaN, over the same axes. Not a softmax's max, which
    needs none (``_fusions.softmax_written_out``)."""
    for node in list(graph):
        arg = node.op_type in ("ArgMax", "ArgMin")
        if node.op_type not in ("ReduceMax", "ReduceMin", "ArgMax", "ArgMin") or node.domain not in ("", "ai.onnx") \
                or _fusions.softmax_written_out(node):
            continue
        x, result = node.inputs[0], node.outputs[0]
        if x is None or _fusions.element_type(x, _SAME_DTYPE) not in _FLOAT_TYPES:
            continue
        is_nan = ir.node("IsNaN", [x])
        added = [is_nan]
        if arg:
            flags = ir.node("Cast", [is_nan.outputs[0]], attributes={"to": ir.DataType.FLOAT})
            axis = node.attributes.get_int("axis", 0)
            keepdims = node.attributes.get_int("keepdims", 1)
            first_nan = ir.node("ArgMax", [flags.outputs[0]], attributes={"axis": axis, "keepdims": keepdims})
            axes = ir.node("Constant", [], attributes={"value": ir.tensor([axis], dtype=ir.DataType.INT64)})
            seen = ir.node("ReduceMax", [flags.outputs[0], axes.outputs[0]], attributes={"keepdims": keepdims})
            added += [flags, first_nan, axes, seen]
            replacement = first_nan
        else:
            flags = ir.node("Cast", [is_nan.outputs[0]], attributes={"to": ir.DataType.UINT8})
            seen = ir.node("ReduceMax", [flags.outputs[0], *node.inputs[1:]], attributes=dict(node.attributes))
            added += [flags, seen, *_constant_like(math.nan, x)]
            replacement = added[-1]
        any_nan = ir.node("Cast", [seen.outputs[0]], attributes={"to": ir.DataType.BOOL})
        fixed = ir.node("Where", [any_nan.outputs[0], replacement.outputs[0], result])
        graph.insert_after(node, [*added, any_nan, fixed])
        _fusions._take_over(result, fixed.outputs[0], "nan_blind")
        fixed.replace_input_with(2, result)  # which the take-over pointed at the fix itself


#: Element types ORT's CUDA provider pads itself (its Pad kernels are for float types).
_CUDA_PAD_TYPES = frozenset({ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.FLOAT16, ir.DataType.BFLOAT16})


def _integer_pads_as_concat(graph: ir.Graph) -> int:
    """A constant Pad of an integer or bool tensor -> a Concat with constant blocks, on CUDA.
    ORT's CUDA provider has no such Pad, so ORT runs it on the CPU, with a copy each way and
    the host waiting for the GPU in between (GPT-2's loss pads its labels: the one node of its
    step not on the GPU, H100). Only static shapes and non-negative constant pads; the count."""
    done = 0
    for node in list(graph):
        if node.op_type != "Pad" or node.domain not in ("", "ai.onnx") or \
                node.attributes.get_string("mode", "constant") != "constant":
            continue
        x = node.inputs[0]
        dims = list(x.shape) if x is not None and x.shape is not None else None
        if x is None or x.dtype is None or x.dtype in _CUDA_PAD_TYPES or dims is None or \
                not all(isinstance(d, int) for d in dims) or (len(node.inputs) > 3 and node.inputs[3] is not None):
            continue
        pads = _fusions._ints(node.inputs[1]) if len(node.inputs) > 1 else None
        fill = _fusions._constant_tensor(node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2] is not None \
            else ir.tensor(np.zeros((), x.dtype.numpy()))
        if pads is None or fill is None or len(pads) != 2 * len(dims) or min(pads) < 0:
            continue
        value, added = x, []
        for axis, (before, after) in enumerate(zip(pads[:len(dims)], pads[len(dims):])):
            if not before and not after:
                continue
            parts = []
            for width, where in ((before, "before"), (after, "after")):
                if width:
                    block = np.full([width if d == axis else n for d, n in enumerate(dims)],
                                    fill.numpy().reshape(-1)[0], dtype=x.dtype.numpy())
                    parts.append(_fusions._initializer(graph, f"{node.name}_pad{axis}_{where}", block))
            parts.insert(1 if before else 0, value)
            added.append(ir.node("Concat", parts, attributes={"axis": axis}))
            value = added[-1].outputs[0]
            dims[axis] += before + after
        if not added:
            continue
        graph.insert_before(node, added)
        _fusions._take_over(node.outputs[0], value, "padded")
        graph.remove(node, safe=True)
        done += 1
    return done


def _constant_like(number: float, like: ir.Value) -> list[ir.Node]:
    """The nodes making ``number`` in ``like``'s dtype, in order; the last one's output is it."""
    constant = ir.node("Constant", [], attributes={"value_float": number})
    return [constant, ir.node("CastLike", [constant.outputs[0], like])]


def _sigmoid_from_exp(graph: ir.Graph) -> None:
    """ORT's CPU Sigmoid is a float32 approximation that returns 0 below about -16
    (onnxruntime 1.31: sigmoid(-20) = 0, torch 2.1e-9; in float64, sigmoid(-30) is 0.1% off).
    Write it as 1 / (1 + exp(-x)), as torch computes it; the pointwise kernels fuse the four
    ops into the same loop they made of Sigmoid."""
    for node in list(graph):
        if node.op_type != "Sigmoid" or node.domain not in ("", "ai.onnx"):
            continue
        x = node.inputs[0]
        if x is None or x.dtype not in (ir.DataType.FLOAT, ir.DataType.DOUBLE):
            continue
        *make_one, one = _constant_like(1.0, x)
        exp = ir.node("Exp", [ir.node("Neg", [x]).outputs[0]])
        total = ir.node("Add", [one.outputs[0], exp.outputs[0]])
        result = ir.node("Div", [one.outputs[0], total.outputs[0]])
        graph.insert_after(node, [*make_one, one, exp.inputs[0].producer(), exp, total, result])
        _fusions._take_over(node.outputs[0], result.outputs[0], "approximate")


def _sort_nan_as_largest(graph: ir.Graph) -> None:
    """torch's sort/topk/argsort/kthvalue order NaN above +inf; ORT's TopK puts NaNs
    anywhere (onnxruntime 1.31). Each float TopK becomes two stable full sorts, as a sort
    by (is NaN, value with NaN as +inf) would be: by the value first, then by the NaN flag
    (TopK breaks ties by the lower index, so the second keeps the first's order), and the
    first K of the result."""
    for node in list(graph):
        if node.op_type != "TopK" or node.domain not in ("", "ai.onnx"):
            continue
        x, k = node.inputs[0], node.inputs[1]
        if x is None or x.dtype not in _FLOAT_TYPES:
            continue
        axis = node.attributes.get_int("axis", -1)
        largest = node.attributes.get_int("largest", 1)
        added = []

        def add(op_type, inputs, outputs=1, **attributes):
            new = ir.node(op_type, inputs, attributes=attributes, num_outputs=outputs)
            added.append(new)
            return new.outputs

        def ints(*values):
            return add("Constant", [], value=ir.tensor(list(values), dtype=ir.DataType.INT64))[0]

        def full_sort(key):
            return add("TopK", [key, length], outputs=2, axis=axis, largest=largest, sorted=1)[1]

        is_nan = add("IsNaN", [x])[0]
        added += _constant_like(math.inf, x)
        infinity = added[-1].outputs[0]
        length = add("Gather", [add("Shape", [x])[0], ints(axis)], axis=0)[0]
        by_value = full_sort(add("Where", [is_nan, infinity, x])[0])
        flags = add("GatherElements", [add("Cast", [is_nan], to=ir.DataType.FLOAT)[0], by_value], axis=axis)[0]
        order = add("GatherElements", [by_value, full_sort(flags)], axis=axis)[0]
        indices = add("Slice", [order, ints(0), k, ints(axis)])[0]
        values = add("GatherElements", [x, indices], axis=axis)[0]
        graph.insert_after(node, added)
        _fusions._take_over(node.outputs[0], values, "nan_unordered")
        _fusions._take_over(node.outputs[1], indices, "nan_unordered")


def _static(shape) -> bool:
    return shape is not None and all(isinstance(d, int) for d in shape.dims)


def _bfloat16_ok_on_cpu(node: ir.Node) -> bool:
    """Whether ORT's CPU kernel of ``node`` takes bfloat16 as it is. Its scatters do only
    without a reduction (probed on onnxruntime 1.31: "BFloat16 data type is not supported with
    ScatterND ... when reduction is 'add'"): a gather's gradient in a bfloat16 graph failed at
    run time and its partition fell back to PyTorch."""
    if node.op_type in ("ScatterND", "ScatterElements"):
        return node.attributes.get_string("reduction", "none") == "none"
    return node.op_type in _BF16_OK_ON_CPU


def _compute_bfloat16_in_float32(graph: ir.Graph) -> None:
    """ORT's CPU EP lacks bf16 kernels for most ops. Do as eager does on CPU: compute each op
    in fp32 and round its result to bf16, so values match eager's op by op."""
    bf16 = ir.DataType.BFLOAT16
    for node in graph:  # values inlined from torchlib functions carry no dtype: the ones that matter
        out = node.outputs[0] if node.outputs else None
        if out is None or out.dtype is not None or node.domain not in ("", "ai.onnx"):
            continue
        if node.op_type == "Constant" and "value" in node.attributes:
            out.dtype = node.attributes["value"].value.dtype
        elif node.op_type == "CastLike" and node.inputs[1] is not None and node.inputs[1].dtype is not None:
            out.dtype = node.inputs[1].dtype  # hardtanh's bounds
        elif node.op_type == "Cast":
            out.dtype = ir.DataType(node.attributes.get_int("to"))
        elif node.op_type in _TYPE_OF_FIRST_INPUT and node.inputs and node.inputs[0] is not None \
                and node.inputs[0].dtype is not None:
            for value in node.outputs:  # a lowering's Pad (Tensor.unfold): else its float32 result went on unrounded
                value.dtype = node.inputs[0].dtype
    for node in list(graph):
        if not _bfloat16_ok_on_cpu(node) and node.domain in ("", "ai.onnx"):
            if node.op_type in ("ScatterND", "ScatterElements"):
                _type_scatter_data(node, bf16)
            _in_float32(graph, node, bf16)
    _round_into_bfloat16_moves(graph)


def _type_scatter_data(node: ir.Node, dtype: ir.DataType) -> None:
    """A scatter's data, updates and result share one type: where one of them is ``dtype``,
    the untyped others (inlined from torchlib's scatter_reduce) are typed so too."""
    data = (node.inputs[0], node.inputs[2], node.outputs[0])
    if any(v is not None and v.dtype == dtype for v in data):
        for value in data:
            if value is not None and value.dtype is None:
                value.dtype = dtype


#: Data-movement ops ORT runs in bfloat16 (a scatter without a reduction too).
_BF16_MOVES = (_BF16_OK_ON_CPU & _TYPE_OF_FIRST_INPUT) | {"ScatterND", "ScatterElements"}


def _moved_inputs(node: ir.Node) -> range | tuple[int, ...]:
    """The positions of the inputs a data-movement op moves: all of a Concat's, a scatter's
    data and updates, else the first."""
    if node.op_type == "Concat":
        return range(len(node.inputs))
    return (0, 2) if node.op_type in ("ScatterND", "ScatterElements") else (0,)


def _round_into_bfloat16_moves(graph: ir.Graph) -> None:
    """A bfloat16 result moved by one of these ops, where the value moved is a lowering's last
    arithmetic, computed in float32 and left untyped (torchlib's mean: ReduceMean, then a
    Squeeze that makes the op's bfloat16 result; also mv, dot, var_mean, cross): rounded to
    bfloat16 there, where eager rounds the op's result. ORT refused the model ("Type
    (tensor(bfloat16)) of output arg (mean) ... does not match expected type (tensor(float))")."""
    bf16 = ir.DataType.BFLOAT16
    for node in list(graph):
        if node.op_type not in _BF16_MOVES or node.domain not in ("", "ai.onnx") \
                or not any(v.dtype == bf16 for v in node.outputs):
            continue
        for index in _moved_inputs(node):
            value = node.inputs[index] if index < len(node.inputs) else None
            if value is None or value.dtype not in (None, ir.DataType.FLOAT):
                continue
            producer = value.producer()
            if value.dtype is None and (producer is None or _bfloat16_ok_on_cpu(producer)):
                continue  # moved on from bfloat16 data, untyped: bfloat16 already
            _cast_input(graph, node, index, bf16)


#: Ops whose second input is an index tensor, which ONNX types int32 or int64 only.
_INDEXED_OPS = frozenset({"Gather", "GatherElements", "GatherND", "ScatterElements", "ScatterND"})


def _indices_as_int64(graph: ir.Graph) -> None:
    """Indices of another integer type (torch's gather takes an empty uint8 index, and its
    backward's scatter then failed ORT's type check, so it ran in PyTorch) cast to int64:
    the values are the same."""
    narrow = {ir.DataType.UINT8, ir.DataType.INT8, ir.DataType.INT16, ir.DataType.UINT16, ir.DataType.UINT32}
    for node in list(graph):
        if node.op_type not in _INDEXED_OPS or node.domain not in ("", "ai.onnx") or len(node.inputs) < 2:
            continue
        if node.inputs[1] is not None and node.inputs[1].dtype in narrow:
            _cast_input(graph, node, 1, ir.DataType.INT64)


def _float16_gaps_in_float32(graph: ir.Graph) -> None:
    """The float16 kernels ORT's CPU provider lacks (probed on onnxruntime 1.31), computed in
    float32: in a float16 graph each failed at run time and its partition fell back to PyTorch.
    - IsInf (torchlib's and our lowerings of log1p, expm1, atan2, logaddexp, logcumsumexp use it):
      its input cast up, exactly.
    - Scatters that reduce, but for ScatterElements' max and min ("MLFloat16 data type is not
      supported with ScatterElements opset 16 when reduction is 'add'": adaptive max pooling's
      and a gather's gradients, scatter_reduce, index_reduce): reduced in float32, rounded to
      float16 once (eager rounds after each add: the same where an index is hit once, within a
      float16 step where it is hit more often)."""
    for node in list(graph):
        if node.domain not in ("", "ai.onnx"):
            continue
        if node.op_type == "IsInf":
            if node.inputs[0].dtype is None and _dtype_through_arithmetic(node.inputs[0]) == ir.DataType.FLOAT16:
                node.inputs[0].dtype = ir.DataType.FLOAT16  # inlined from a lowering, untyped
            _in_float32(graph, node, ir.DataType.FLOAT16)
            continue
        if node.op_type not in ("ScatterND", "ScatterElements"):
            continue
        reduction = node.attributes.get_string("reduction", "none")
        if reduction == "none" or (node.op_type == "ScatterElements" and reduction in ("max", "min")):
            continue
        _type_scatter_data(node, ir.DataType.FLOAT16)
        _in_float32(graph, node, ir.DataType.FLOAT16, inputs=(0, 2))


#: Ops whose float result has the type of their float operands.
_ARITHMETIC = frozenset({"Add", "Sub", "Mul", "Div", "Neg", "Abs", "Exp", "Log", "Sqrt", "Max", "Min", "Where",
                         "Identity", "Reciprocal", "Pow", "Sin", "Cos", "Tanh", "Sigmoid", "Softplus",
                         "ReduceMax", "ReduceMin", "ReduceSum", "ReduceMean", "CumSum"})
#: Of those, the ones whose first input alone is their data (an exponent, axes, a condition follow).
_FIRST_OPERAND_ONLY = frozenset({"Pow", "ReduceMax", "ReduceMin", "ReduceSum", "ReduceMean", "CumSum"})


def _dtype_through_arithmetic(value: ir.Value, depth: int = 8) -> ir.DataType | None:
    """The type of an untyped value, from the first typed operand up its chain of arithmetic
    (values inlined from a lowering carry none)."""
    if value.dtype is not None or depth == 0:
        return value.dtype
    producer = value.producer()
    if producer is None or producer.op_type not in _ARITHMETIC or producer.domain not in ("", "ai.onnx"):
        return None
    operands = producer.inputs[1:] if producer.op_type == "Where" else producer.inputs[:1] \
        if producer.op_type in _FIRST_OPERAND_ONLY else producer.inputs
    for operand in operands:
        found = operand is not None and _dtype_through_arithmetic(operand, depth - 1)
        if found:
            return found
    return None


def _in_float32(graph: ir.Graph, node: ir.Node, low: ir.DataType, inputs=None) -> None:
    """``node`` computed in float32: its inputs of type ``low`` (those at ``inputs``, or all)
    cast up, its outputs of that type cast back (the outputs keep their names, the graph its
    outputs)."""
    fp32 = ir.DataType.FLOAT
    for index, value in enumerate(node.inputs):
        if value is not None and value.dtype == low and (inputs is None or index in inputs):
            _cast_input(graph, node, index, fp32)
    for value in node.outputs:
        if value.dtype != low:
            continue
        name = value.name
        value.name = name + "_fp32"
        down = ir.node("Cast", [None], attributes={"to": low})
        rounded = down.outputs[0]
        rounded.name, rounded.dtype, rounded.shape = name, low, value.shape
        value.replace_all_uses_with(rounded, replace_graph_outputs=True)
        down.replace_input_with(0, value)
        value.dtype = fp32
        graph.insert_after(node, down)


def _cast_input(graph: ir.Graph, node: ir.Node, index: int, dtype: ir.DataType) -> None:
    """``node`` reads its input ``index`` cast to ``dtype`` by a Cast placed before it."""
    value = node.inputs[index]
    cast = ir.node("Cast", [value], attributes={"to": dtype})
    cast.outputs[0].dtype, cast.outputs[0].shape = dtype, value.shape
    graph.insert_before(node, cast)
    node.replace_input_with(index, cast.outputs[0])
