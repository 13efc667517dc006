"""Hand-written kernels of the ``ort_dynamo.pointwise`` domain for single ONNX ops that ORT's
CPU provider runs slowly (csrc/max_pool.h, csrc/pointwise_runtime.c):

- Max pooling with indices. ``lowerings/core._max_pool_with_indices`` gives torch's semantics
  with portable ops: ONNX MaxPool with Indices, a Sub for per-plane numbering, and a second
  MaxPool over NaN positions (ORT's skips NaN). With Indices, ORT pools in a generic loop (8.5
  ms of ResNet's stem pooling, 8x64x64x64: ``layer_ops.py --profile max_pool2d``), without in
  its blocked layout. ``TorchMaxPool_*`` computes torch's values and indices in one pass.
- Its gradient, a ScatterElements adding along the last axis into zeros, on one thread in ORT:
  ``ScatterAddLastAxis``, parallel over rows.
- Transposes that move the innermost axis and more than one axis, or keep it but it is short,
  which ORT moves element by element (or a few floats at a time) on one thread (pixel shuffle
  and its gradient, einops' patch rearrangements): ``TransposeRows``; and bfloat16 Transposes
  where ORT's bfloat16 path is slower still (attention's k transposed): ``TransposeRowsBf16``.
  (``decompositions`` writes pixel shuffle as such a transpose.) Symbolic sizes too: the
  kernel reads them at run time.

- Attention's heads moved back into rows, a Transpose [0, 2, 1, 3] of [B, H, S, D] that ORT
  copies slower than rows of D can be: ``MergeHeads``; and GPT-2's q, k and v gradients, three
  such moves concatenated for its one projection, which ORT runs as three Transposes and a
  Concat: ``ConcatHeads3``, one pass (csrc/pointwise_runtime.c, ``pw_merge_heads``). And the
  reverse in the forward: GPT-2's projection split into q, k and v, each plus its bias and moved
  into heads' layout, which ORT runs as a Split and a kernel per part: ``SplitHeads3Bias``
  (``pw_split_heads``).
- 2-D convolutions with one output channel per group, which ORT runs as an im2col and a GEMM
  per (image, group): depthwise convolutions (ConvNeXt's, MobileNet's, SegFormer's), their
  input gradients (a grouped ConvTranspose) and their weight gradients (the batch-1 grouped
  Conv ``decompositions._conv_weight_grad`` writes): ``TorchGroupConv_*`` (csrc/group_conv.h).
- Expands that broadcast the last axis (a mean's gradient), which ORT fills a few floats at a
  time: a MatMul by a row of ones, then an Expand of whole rows (ORT ops, no kernel).
- Scaled dot-product attention kept whole as flash attention for CPU (``lowerings/attention.py``:
  ``FlashAttentionCpu`` and its gradient, torch's kernel through its C shim): ``TorchAttention_*``
  (csrc/attention.h), ort_dynamo's own forward and backward, in the model the kernels build.
- CPU autocast's matrix products: a MatMul of two bfloat16 values (Casts to float32, through
  views) whose result is rounded to bfloat16, which eager computes with oneDNN's AVX512-BF16
  kernels and ORT with float32 GEMMs only: ``Bf16MatMul*`` (csrc/bf16_gemm.h), where the
  compiler targets AVX512-BF16.

The portable ops stay in the model the session runs while the kernels compile, and wherever
a pattern is not exactly the one described.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np
import onnx_ir as ir

from ._fusions import (_constant_tensor, _initializer, _int64_constant, _named_dims, _op, _remove_if_dead, _scalar,
                       _sole_user, _take_over, _zeros_shape, element_type)

__all__ = ["ATTENTION_HEAD_MULTIPLE", "DOMAIN", "attentions_as_kernels", "axis_softmaxes_as_kernels", "bf16_matmul_kernel",
           "bf16_matmuls_as_kernels", "blas_products", "conv_weight_grads_as_kernels", "convs_as_kernels", "f32_matmul_kernel",
           "f32_matmuls_as_kernels", "gathered_max_pools_as_kernels",
           "group_convs_as_kernels", "max_pools_as_kernels", "merge_heads_kernel", "merged_heads_as_kernels",
           "moves_heads", "scatter_adds_along_last_axis", "slow_expands_as_products", "slow_transposes_as_kernels",
           "split_heads_as_kernels", "split_heads_kernel", "transpose_rows_kernel", "transposes_without_unit_axes"]

#: The domain of the custom-op library (csrc/pointwise_runtime.c): these ops' and ``_pointwise``'s.
DOMAIN = "ort_dynamo.pointwise"

#: The gradient's kernel (csrc/pointwise_runtime.c), the same for every use.
SCATTER_ADD_LAST_AXIS = "\n".join([
    '#include "pointwise.h"',
    "static const int ScatterAddLastAxis_types[] = {PW_INT64, PW_INT64, PW_FLOAT};",
    "static const int ScatterAddLastAxis_none[] = {0};",
    "PW_KERNEL(ScatterAddLastAxis, 3, ScatterAddLastAxis_types, ScatterAddLastAxis_none, 1, ScatterAddLastAxis_none, "
    "0, 0, 0, 0, pw_scatter_add_last_axis);",
]) + "\n"


#: The transposes' kernel: x and the permutation (an int64 constant).
TRANSPOSE_ROWS = "\n".join([
    '#include "pointwise.h"',
    "static const int TransposeRows_types[] = {PW_FLOAT, PW_INT64};",
    "static const int TransposeRows_none[] = {0};",
    "PW_KERNEL(TransposeRows, 2, TransposeRows_types, TransposeRows_none, 1, TransposeRows_none, 0, 0, 0, 0, "
    "pw_transpose);",
]) + "\n"
#: The same for bfloat16 tensors.
TRANSPOSE_ROWS_BF16 = "\n".join([
    '#include "pointwise.h"',
    "static const int TransposeRowsBf16_types[] = {PW_BF16, PW_INT64};",
    "static const int TransposeRowsBf16_out[] = {PW_BF16};",
    "static const int TransposeRowsBf16_none[] = {0};",
    "PW_KERNEL(TransposeRowsBf16, 2, TransposeRowsBf16_types, TransposeRowsBf16_none, 1, TransposeRowsBf16_none, 0, "
    "0, 0, 0, pw_transpose, 0, TransposeRowsBf16_out);",
]) + "\n"
#: Fewer elements stay ORT's: its loop costs microseconds there.
_MIN_TRANSPOSED = 16384
_INT64_MAX = 2**63 - 1
#: An innermost axis that stays innermost, ORT copies in blocks of its length: fine from here.
_MIN_BLOCK = 16
#: Output rows this short, ORT's transposes that move one axis write slowly.
_SHORT_ROW = 64
#: ORT folds a Transpose into these (FusedMatMul): no kernel there.
_READS_TRANSPOSED = {"MatMul", "Gemm", "FusedMatMul"}
#: The types ``MergeHeads`` and ``ConcatHeads`` move.
_HEAD_TYPES = (ir.DataType.FLOAT, ir.DataType.BFLOAT16)


def _window_geometry(attributes, spatial: int) -> tuple | None:
    """(strides, pads before, pads after, dilations) of a Conv's, ConvTranspose's or pooling's
    attributes over ``spatial`` axes, ONNX's defaults where absent; None where ``auto_pad`` is
    set, a list has another length, a stride or dilation is below 1 or a pad below 0."""
    if attributes.get_string("auto_pad", "NOTSET") != "NOTSET":
        return None
    strides = list(attributes.get_ints("strides", [1] * spatial))
    pads = list(attributes.get_ints("pads", [0] * 2 * spatial))
    dilations = list(attributes.get_ints("dilations", [1] * spatial))
    if len(strides) != spatial or len(pads) != 2 * spatial or len(dilations) != spatial \
            or min(strides + dilations) < 1 or min(pads) < 0:
        return None
    return strides, pads[:spatial], pads[spatial:], dilations


def _pooling(node: ir.Node) -> tuple | None:
    """(spatial, kernel, strides, pads before, pads after, dilations, ceil) of a MaxPool the
    kernel computes, else None."""
    attributes = node.attributes
    if attributes.get_int("storage_order", 0) != 0:
        return None
    kernel = list(attributes.get_ints("kernel_shape", []))
    spatial = len(kernel)
    if not 1 <= spatial <= 3 or min(kernel) < 1:
        return None
    geometry = _window_geometry(attributes, spatial)
    if geometry is None:
        return None
    return spatial, kernel, *geometry, attributes.get_int("ceil_mode", 0)


_VIEWS = frozenset({"Unsqueeze", "Reshape", "Identity"})


def _is_float32(value: ir.Value | None) -> bool:
    """Whether ``value`` is float32, looking through the views whose results carry no type (an
    unbatched pooling's Unsqueeze)."""
    return element_type(value, _VIEWS) == ir.DataType.FLOAT


def _is_nan_constant(value: ir.Value | None) -> bool:
    producer = value.producer() if value is not None else None
    if _op(producer, "CastLike"):
        value = producer.inputs[0]
    number = _scalar(value)
    return number is not None and math.isnan(number)


def _nan_lookup(condition: ir.Value | None, x: ir.Value, pooling: tuple) -> bool:
    """Whether ``condition`` is ``_nan_as_torch``'s: Greater(MaxPool(Cast(IsNaN(x)) * positions), 0)
    with the same pooling."""
    greater = condition.producer() if condition is not None else None
    if not _op(greater, "Greater") or _scalar(greater.inputs[1]) != 0.0:
        return False
    pool = greater.inputs[0].producer()
    if not _op(pool, "MaxPool") or _pooling(pool) != pooling:
        return False
    mul = pool.inputs[0].producer()
    if not _op(mul, "Mul"):
        return False
    for operand in mul.inputs:
        cast = operand.producer() if operand is not None else None
        isnan = cast.inputs[0].producer() if _op(cast, "Cast") else None
        if _op(isnan, "IsNaN") and isnan.inputs[0] is x:
            return True
    return False


def _lowered_max_pool(pool: ir.Node) -> tuple[ir.Value, ir.Value, tuple] | None:
    """(values, indices, pooling) that ``_max_pool_with_indices`` computes from ``pool``, its
    MaxPool with Indices, if the model has exactly its pattern."""
    if not _op(pool, "MaxPool") or len(pool.outputs) != 2:
        return None
    pooling, x = _pooling(pool), pool.inputs[0]
    if pooling is None or not _is_float32(x):
        return None
    values, numbered = pool.outputs
    value_uses = [use.node for use in values.uses() if _op(use.node, "Where") and use.idx == 2]
    sub_uses = [use.node for use in numbered.uses() if _op(use.node, "Sub") and use.idx == 0]
    if len(value_uses) != 1 or len(sub_uses) != 1:
        return None
    pick_value = value_uses[0]
    index_uses = [use.node for use in sub_uses[0].outputs[0].uses() if _op(use.node, "Where") and use.idx == 2]
    if len(index_uses) != 1:
        return None
    pick_index = index_uses[0]
    condition = pick_value.inputs[0]
    if pick_index.inputs[0] is not condition or not _is_nan_constant(pick_value.inputs[1]) \
            or not _nan_lookup(condition, pool.inputs[0], pooling):
        return None
    return pick_value.outputs[0], pick_index.outputs[0], pooling


def _max_pool_source(name: str, pooling: tuple) -> str:
    spatial, kernel, strides, before, after, dilations, ceil = pooling
    lead = 3 - spatial  # the kernel's axes are (D, H, W); a pooling without some sees them as 1

    def axes(values, missing):
        return [missing] * lead + list(values)

    numbers = [*axes(kernel, 1), *axes(strides, 1), *axes(before, 0), *axes(after, 0), *axes(dilations, 1)]
    return "\n".join(['#include "max_pool.h"',
                      f"PW_MAX_POOL({name}, {spatial}, {', '.join(str(int(n)) for n in numbers)}, {ceil});",
                      f"PW_KERNEL({name}, 1, {name}_types, {name}_none, 2, {name}_none, 0, 0, 0, 0, {name}_compute, 0, "
                      f"{name}_out_types);"]) + "\n"


def max_pools_as_kernels(graph: ir.Graph) -> list[str]:
    """Each max pooling ``_max_pool_with_indices`` lowered -> one ``TorchMaxPool_*`` node.
    Returns the kernels' C units (one per distinct pooling). The portable chain is left for
    dead-code removal."""
    kernels = {}
    for node in list(graph):
        found = _lowered_max_pool(node)
        if found is None:
            continue
        values, indices, pooling = found
        name = _unit_name(kernels, "TorchMaxPool_", _max_pool_source("@", pooling))
        pool = ir.node(name, [node.inputs[0]], domain=DOMAIN, num_outputs=2)
        graph.insert_before(node, pool)
        _take_over(values, pool.outputs[0])
        _take_over(indices, pool.outputs[1])
        pool.outputs[0].dtype, pool.outputs[1].dtype = ir.DataType.FLOAT, ir.DataType.INT64
    return list(kernels.values())


#: Flash attention for CPU's ops (``lowerings/attention.py``, domain ``_torch_attention.DOMAIN``):
#: op type -> (backward, the count of its operands before the optional mask).
_FLASH_OPS = {"FlashAttentionCpu": (0, 3), "FlashAttentionCpuGrad": (1, 6)}
_MASK_KINDS = {ir.DataType.FLOAT: 1, ir.DataType.BOOL: 2}  # attention.h
#: Head sizes csrc/attention.h takes: whole vectors of 16 floats (``lower`` keeps attention whole
#: for the kernels only then).
ATTENTION_HEAD_MULTIPLE = 16


def attentions_as_kernels(graph: ir.Graph, domain: str) -> list[str]:
    """Each flash attention for CPU op of ``domain`` (torch's kernel: forward or backward) whose
    operands are float32 with a static head size that is a multiple of 16, and whose mask, if
    any, is float32 or bool -> one ``TorchAttention_*`` node (csrc/attention.h): the head size,
    causality, mask type, scale and layout its constants. An operand that is a Transpose of
    [B, S, H, D] (the heads still in a projection's rows) is read there, and an output that only
    Transposes read is written so (``_heads_in_rows``). Returns the kernels' C units."""
    kernels: dict[str, str] = {}
    for node in list(graph):
        if node.domain != domain or node.op_type not in _FLASH_OPS:
            continue
        backward, operands = _FLASH_OPS[node.op_type]
        query = node.inputs[operands - 3]
        head = query.shape[-1] if query.shape is not None and len(query.shape) == 4 else None
        mask = node.inputs[operands] if len(node.inputs) > operands else None
        if not (isinstance(head, int) and head > 0 and head % ATTENTION_HEAD_MULTIPLE == 0) \
                or not all(_is_float32(v) for v in node.inputs[:operands]) \
                or (mask is not None and mask.dtype not in _MASK_KINDS):
            continue
        inputs, layout, read_moves, moved_outputs, written_moves = list(node.inputs), 0, [], [], []
        # Layout bits (attention.h): the 4-D operands in order, inputs then outputs.
        four_d_inputs = [i for i in range(operands) if i != 5]  # not the backward's logsumexp
        four_d_outputs = [0] if not backward else [0, 1, 2]  # not the forward's logsumexp
        for bit, at in enumerate(four_d_inputs):
            source = _heads_in_rows(inputs[at])
            if source is not None:
                read_moves.append(inputs[at].producer())
                inputs[at], layout = source, layout | 1 << bit
        for bit, at in enumerate(four_d_outputs, len(four_d_inputs)):
            if _all_move_heads(node.outputs[at]):
                moved_outputs.append(at)
                layout |= 1 << bit
        attributes = node.attributes
        scale = attributes.get_float("scale", 1.0) if attributes.get_int("has_scale", 0) else 1.0 / math.sqrt(head)
        numbers = [backward, head, attributes.get_int("is_causal", 0),
                   _MASK_KINDS[mask.dtype] if mask is not None else 0, float(scale), layout]
        unit = "\n".join(['#include "attention.h"', f"PW_ATTENTION(@, {', '.join(_c_literal(n) for n in numbers)});",
                          f"PW_KERNEL(@, {len(inputs)}, @_types, @_none, {len(node.outputs)}, @_none, "
                          "0, 0, 0, 0, @_compute, 0, 0);"]) + "\n"
        kernel = ir.node(_unit_name(kernels, "TorchAttention_", unit), inputs, domain=DOMAIN,
                         num_outputs=len(node.outputs))
        graph.insert_before(node, kernel)
        for o, (old, new) in enumerate(zip(node.outputs, kernel.outputs)):
            if o in moved_outputs:  # the kernel writes what the Transposes made
                moves = sorted((use.node for use in old.uses()), key=lambda n: not n.outputs[0].is_graph_output())
                _take_over(moves[0].outputs[0], new)
                for other in moves[1:]:
                    other.outputs[0].replace_all_uses_with(new)
                written_moves.extend(moves)
            else:
                _take_over(old, new)
            new.dtype = ir.DataType.FLOAT
        _remove_if_dead(graph, [*written_moves, node, *read_moves])  # each reader before what it reads
    return list(kernels.values())


def _heads_in_rows(value: ir.Value) -> ir.Value | None:
    """x where ``value`` is Transpose(x, [0, 2, 1, 3]) of float32 x (attention's heads taken out
    of a projection's rows, [B, S, H, D] -> [B, H, S, D]), else None."""
    node = value.producer()
    return node.inputs[0] if _swaps_heads(node) and _is_float32(node.inputs[0]) else None


def _all_move_heads(value: ir.Value) -> bool:
    """Whether only Transposes [0, 2, 1, 3] read ``value`` (not a graph output), at most one of
    them a graph output."""
    readers = [use.node for use in value.uses()]
    return bool(readers) and not value.is_graph_output() \
        and all(_swaps_heads(n) for n in readers) \
        and sum(n.outputs[0].is_graph_output() for n in readers) <= 1


_SOFTMAX_KINDS = {"Softmax": 0, "LogSoftmax": 1, "softmax gradient": 2, "log-softmax gradient": 3}  # axis_softmax.h


def _channel_axis(value: ir.Value, axis: int) -> tuple[int, int] | None:
    """(axis, its length) of float32 ``value`` where ``axis`` is not its last and has a static
    length above 1, the rest of its shape of any sizes, else None."""
    shape = value.shape if _is_float32(value) else None
    if shape is None or not 2 <= len(shape) <= 8 or not -len(shape) <= axis < len(shape):
        return None
    axis %= len(shape)
    if axis == len(shape) - 1:  # rows: the pointwise kernels' own softmax
        return None
    length = shape[axis]
    if not isinstance(length, int) or length < 2 or (all(isinstance(d, int) for d in shape)
                                                     and math.prod(shape) < _MIN_AXIS_SOFTMAX):
        return None
    return axis, length


def _summed_axis(total: ir.Node | None, value: ir.Value) -> tuple[int, int] | None:
    """(axis, length) of a ReduceSum of ``value`` over one axis, kept, that is not its last."""
    if not _op(total, "ReduceSum") or total.inputs[0] is not value or len(total.inputs) != 2 \
            or total.attributes.get_int("keepdims", 1) != 1:
        return None
    axes = _ints_of_any_shape(total.inputs[1])
    return _channel_axis(value, int(axes.reshape(-1)[0])) if axes is not None and axes.size == 1 else None


def _softmax_gradient(sub: ir.Node) -> tuple[str, list, list] | None:
    """(macro, numbers, inputs) of csrc/axis_softmax.h's kernel computing ``sub``, where it ends
    the gradient of a softmax or log-softmax y over a channel axis as torch's decompositions
    write it: g - exp(y) * sum(g) (log-softmax; with a one-hot g, from its targets),
    p - y * sum(p) with p = g * y (softmax)."""
    if not _op(sub, "Sub"):
        return None
    first, scaled = sub.inputs
    mul = scaled.producer() if scaled is not None else None
    if not _op(mul, "Mul"):
        return None
    for factor, total in (mul.inputs, mul.inputs[::-1]):
        found = _summed_axis(total.producer() if total is not None else None, first)
        if found is None or factor is None:
            continue
        axis, length = found
        exp = factor.producer()
        if _op(exp, "Exp") and _is_float32(exp.inputs[0]) and exp.inputs[0].shape == first.shape:
            y = exp.inputs[0]
            one_hot = _one_hot(first, axis, length)
            if one_hot is not None:
                index, scale, hit, miss = one_hot
                return "PW_AXIS_LOG_SOFTMAX_ONE_HOT_GRAD", [axis, length, hit, miss], [index, scale, y]
            return "PW_AXIS_SOFTMAX", [_SOFTMAX_KINDS["log-softmax gradient"], axis, length], [first, y]
        product = first.producer()
        if _op(product, "Mul") and factor in product.inputs and factor.shape == first.shape:
            g = product.inputs[1] if product.inputs[0] is factor else product.inputs[0]
            if g is not None and g.shape == first.shape and _is_float32(g):
                return "PW_AXIS_SOFTMAX", [_SOFTMAX_KINDS["softmax gradient"], axis, length], [g, factor]
    return None


def _one_hot(g: ir.Value, axis: int, length: int) -> tuple | None:
    """(index, scale, hit, miss) where ``g`` is Where(iota == index, hit, miss) * scale, iota the
    numbers 0..length-1 along ``axis``, index (int64) and scale (float32) of g's shape but for
    one value along it, hit and miss numbers: a cross-entropy's gradient before its softmax's
    (torch's nll_loss backward, decomposed)."""
    product = g.producer()
    if not _op(product, "Mul") or g.is_graph_output() or len(g.uses()) != 2:
        return None  # the ReduceSum and the Sub of the log-softmax's gradient, nothing else
    for picked, scale in (product.inputs, product.inputs[::-1]):
        where = picked.producer() if picked is not None else None
        if not _op(where, "Where") or scale is None or not _is_float32(scale):
            continue
        equal, hit, miss = where.inputs[0].producer(), _scalar(where.inputs[1]), _scalar(where.inputs[2])
        if not _op(equal, "Equal") or hit is None or miss is None:
            continue
        for iota, index in (equal.inputs, equal.inputs[::-1]):
            numbers = _ints_of_any_shape(iota)
            shape = list(g.shape or [])
            if numbers is None or index is None or index.dtype != ir.DataType.INT64 \
                    or not np.array_equal(numbers.reshape(-1), np.arange(length)) \
                    or not len(shape) - axis <= numbers.ndim <= len(shape) \
                    or numbers.shape[axis - len(shape)] != length:  # the classes along the softmax's axis
                continue
            one = shape[:axis] + [1] + shape[axis + 1:]
            if all(v.shape is not None and list(v.shape) == one for v in (index, scale)):
                return index, scale, hit, miss
    return None


def _ints_of_any_shape(value: ir.Value | None) -> np.ndarray | None:
    """The integers of an int64 constant, else None."""
    tensor = _constant_tensor(value)
    return tensor.numpy() if tensor is not None and tensor.dtype == ir.DataType.INT64 else None


def axis_softmaxes_as_kernels(graph: ir.Graph) -> list[str]:
    """Softmax and LogSoftmax over an axis other than the last (a segmentation loss's classes)
    and their gradients -> ``TorchAxisSoftmax_*`` nodes (csrc/axis_softmax.h): one pass each,
    where ORT moves the axis last and back, or runs five passes written out. Before the
    pointwise stage expands softmaxes. Returns the kernels' C units."""
    kernels: dict[str, str] = {}
    for node in list(graph):
        if _op(node, "Softmax") or _op(node, "LogSoftmax"):
            found = _channel_axis(node.inputs[0], node.attributes.get_int("axis", -1))
            kernel = found and ("PW_AXIS_SOFTMAX", [_SOFTMAX_KINDS[node.op_type], *found], [node.inputs[0]])
        else:
            kernel = _softmax_gradient(node)
        if kernel:
            macro, numbers, inputs = kernel
            _window_kernel(graph, kernels, "TorchAxisSoftmax_", "axis_softmax.h", macro, numbers, inputs, node,
                           node.outputs[0])
    return list(kernels.values())  # the replaced chains are dead: the caller removes them


def _ints_of(value: ir.Value | None) -> np.ndarray | None:
    """The integers of a 1-D int64 constant, else None."""
    array = _ints_of_any_shape(value)
    return array if array is not None and array.ndim == 1 else None


def _gathered_windows(tiles: ir.Value, spatial: int) -> tuple[ir.Value, list[np.ndarray]] | None:
    """(x, per spatial axis its positions) where ``tiles`` is ``decompositions._adaptive_max_pool``'s
    gather of x's windows: a Gather along each spatial axis but the last, then the last's as a
    Gather of rows between two Transposes of the last two axes; each step before the tiles read
    only by the next."""
    rank = spatial + 2
    swap = [*range(rank - 2), rank - 1, rank - 2]

    def step(value, op, check, alone=True):
        node = value.producer() if value is not None else None
        if not _op(node, op) or value.is_graph_output() or (alone and len(value.uses()) != 1) or not check(node):
            return None
        return node

    def swaps(node):
        return [int(p) for p in node.attributes.get_ints("perm", [])] == swap

    def gathers(axis):
        return lambda node: node.attributes.get_int("axis", 0) % rank == axis and _ints_of(node.inputs[1]) is not None

    after = step(tiles, "Transpose", swaps, alone=False)  # the pooling's NaN lookup reads the tiles too
    rows = after and step(after.inputs[0], "Gather", gathers(rank - 2))
    before = rows and step(rows.inputs[0], "Transpose", swaps)
    if before is None:
        return None
    tables, value = [_ints_of(rows.inputs[1])], before.inputs[0]
    for d in reversed(range(spatial - 1)):
        gather = step(value, "Gather", gathers(2 + d))
        if gather is None:
            return None
        tables.insert(0, _ints_of(gather.inputs[1]))
        value = gather.inputs[0]
    return value, tables


def _table_lookup(index: ir.Value) -> ir.Node | None:
    """The Gather (axis 0, of a constant table) that looks up ``index`` flattened by Reshapes,
    each read only by the next."""
    value, flat = index, False
    while True:
        if value.is_graph_output() or len(value.uses()) != 1:
            return None
        node = value.uses()[0].node
        if _op(node, "Reshape") and node.inputs[0] is value:
            target = _ints_of(node.inputs[1])
            flat = target is not None and len(target) == 1
            value = node.outputs[0]
            continue
        if _op(node, "Gather") and node.inputs[1] is value and node.attributes.get_int("axis", 0) == 0 \
                and _ints_of(node.inputs[0]) is not None and value is not index and flat:
            return node
        return None


def gathered_max_pools_as_kernels(graph: ir.Graph) -> list[str]:
    """Adaptive max pooling over windows that overlap, as ``decompositions._adaptive_max_pool``
    writes it (its windows gathered into tiles, a max pooling of the tiles, a table lookup of
    each maximum's plane position) -> one ``TorchGatheredMaxPool_*`` node reading the windows in
    place (csrc/max_pool.h). Gathering took 1.8 of the forward's 3.0 ms at [8, 64, 56, 56] into
    6 x 6 (``layer_ops.py --profile adaptive_max_uneven``). Static spatial sizes only, as the
    decomposition is. Returns the kernels' C units; the chains are left for dead-code removal."""
    kernels: dict[str, str] = {}
    for node in list(graph):
        found = _lowered_max_pool(node)
        if found is None:
            continue
        values, index, (spatial, kernel, strides, before, after, dilations, ceil) = found
        if kernel != strides or max(before + after) > 0 or max(dilations) > 1 or ceil:
            continue
        windows = _gathered_windows(node.inputs[0], spatial)
        lookup = _table_lookup(index)
        if windows is None or lookup is None:
            continue
        x, tables = windows
        sizes = list(x.shape or [])[2:]
        if len(sizes) != spatial or not all(isinstance(n, int) for n in sizes) or any(
                len(t) % k or t.min(initial=0) < 0 or t.max(initial=0) >= n for t, k, n in zip(tables, kernel, sizes)):
            continue
        positions = tables[0]
        for table, n in zip(tables[1:], sizes[1:]):
            positions = (positions[:, None] * n + table[None, :]).reshape(-1)
        if not np.array_equal(_ints_of(lookup.inputs[0]), positions):
            continue
        lead = 3 - spatial  # the kernel's axes are (D, H, W); a pooling without some sees them as 1
        tables3 = [np.zeros(1, np.int64)] * lead + tables
        k3, i3 = [1] * lead + list(kernel), [1] * lead + sizes
        o3 = [len(t) // k for t, k in zip(tables3, k3)]
        lines = ['#include "max_pool.h"']
        lines += [f"static const int64_t @_r{axis}[] = {{{', '.join(str(int(v)) for v in table)}}};"
                  for axis, table in zip("dhw", tables3)]
        lines += [f"PW_GATHERED_MAX_POOL(@, {spatial}, {', '.join(str(n) for n in k3 + o3 + i3)});",
                  "PW_KERNEL(@, 1, @_types, @_none, 2, @_none, 0, 0, 0, 0, @_compute, 0, @_out_types);"]
        name = _unit_name(kernels, "TorchGatheredMaxPool_", "\n".join(lines) + "\n")
        pool = ir.node(name, [x], domain=DOMAIN, num_outputs=2)
        shape = graph.initializers.get("pointwise_flat") or _int64_constant(graph, "pointwise_flat", [-1])
        flat = ir.node("Reshape", [pool.outputs[1], shape])
        graph.insert_before(node, [pool, flat])
        _take_over(values, pool.outputs[0])
        _take_over(lookup.outputs[0], flat.outputs[0])
        pool.outputs[0].dtype, pool.outputs[1].dtype = ir.DataType.FLOAT, ir.DataType.INT64
        flat.outputs[0].dtype = ir.DataType.INT64
    return list(kernels.values())


def _unit_name(kernels: dict, prefix: str, source: str) -> str:
    """The name of the C unit ``source`` (``@`` where the name goes): ``prefix`` and the unit's
    hash. The unit, named, is added to ``kernels`` (name: unit)."""
    name = prefix + hashlib.sha256(source.encode()).hexdigest()[:16]
    kernels[name] = source.replace("@", name)
    return name


def _c_literal(number) -> str:
    """An int as C writes it; a float as the exact float32 C literal (hexadecimal)."""
    return f"{float(np.float32(number)).hex()}f" if isinstance(number, float) else str(int(number))


def _window_kernel(graph: ir.Graph, kernels: dict, prefix: str, header: str, macro: str, numbers, inputs: list,
                   before: ir.Node, replaced: ir.Value) -> ir.Node:
    """One float32 node of ``inputs`` computing ``replaced``, inserted before ``before``: the
    op of csrc/``header``'s ``macro`` instantiated with ``numbers`` (a window's constants: ints,
    or floats as float32 literals), named as ``_unit_name`` names it."""
    lines = [f'#include "{header}"', f"{macro}(@, {', '.join(_c_literal(n) for n in numbers)});",
             f"PW_KERNEL(@, {len(inputs)}, @_types, @_none, 1, @_none, 0, 0, 0, 0, @_compute, 0, 0);"]
    node = ir.node(_unit_name(kernels, prefix, "\n".join(lines) + "\n"), inputs, domain=DOMAIN)
    graph.insert_before(before, node)
    _take_over(replaced, node.outputs[0])
    node.outputs[0].dtype = ir.DataType.FLOAT  # a value inside an inlined function has none to take over
    return node


def _group_convolution(node: ir.Node) -> tuple | None:
    """(transposed, bias, kernel, strides, pads before, pads after, dilations, planes) of a
    float32 2-D Conv with groups of one output channel, or such a ConvTranspose with groups of
    one input channel, else None. ``pads after``: a ConvTranspose's output padding less them.
    Planes: H, W, OH, OW as csrc/group_conv.h names them. A size that is symbolic (as are the
    window of a weight gradient and the planes under ``dynamic=True``) is -1: the kernel reads
    it at run time."""
    if node.op_type not in ("Conv", "ConvTranspose") or node.domain not in ("", "ai.onnx") \
            or not 2 <= len(node.inputs) <= 3:
        return None
    transposed = node.op_type == "ConvTranspose"
    x, w = node.inputs[0], node.inputs[1]
    bias = node.inputs[2] if len(node.inputs) == 3 else None
    dims, wdims = _dims_or_unknown(x), _dims_or_unknown(w)
    attributes = node.attributes
    group = attributes.get_int("group", 1)
    if dims is None or wdims is None or len(dims) != 4 or len(wdims) != 4 or group < 2 or 0 in dims \
            or not _is_float32(x) or not _is_float32(w) or (bias is not None and not _is_float32(bias)) \
            or "output_shape" in attributes:
        return None
    if wdims[0] != group or (transposed and dims[1] != group):
        return None
    if not transposed and -1 not in (dims[1], wdims[1]) and dims[1] != group * wdims[1]:
        return None
    kernel = wdims[2:]
    if -1 not in kernel and list(attributes.get_ints("kernel_shape", kernel)) != kernel:
        return None
    geometry = _window_geometry(attributes, 2)
    extra = list(attributes.get_ints("output_padding", [0, 0])) if transposed else [0, 0]
    if geometry is None or len(extra) != 2 or min([k for k in kernel if k != -1] + [1]) < 1 or min(extra) < 0:
        return None
    strides, before, pads_after, dilations = geometry
    after = [e - p for e, p in zip(extra, pads_after)] if transposed else pads_after
    sizes = [_convolution_size(n, k, s, p, a, d, transposed) if -1 not in (n, k) else -1
             for n, k, s, p, a, d in zip(dims[2:], kernel, strides, before, after, dilations)]
    if 0 in sizes:
        return None
    planes = [*sizes, *dims[2:]] if transposed else [*dims[2:], *sizes]
    return int(transposed), int(bias is not None), kernel, strides, before, after, dilations, planes


def _convolution_size(n: int, k: int, s: int, before: int, after: int, d: int, transposed: bool) -> int:
    """ONNX's output length of a Conv (or ConvTranspose) along one axis, 0 if none (as
    ``pw_conv_length`` in csrc/group_conv.h; a ConvTranspose's ``after``: its output padding
    less its pads after)."""
    span = d * (k - 1) + 1
    if transposed:
        return max(s * (n - 1) + span - before + after, 0)
    return (n + before + after - span) // s + 1 if n + before + after >= span else 0


def _dims_or_unknown(value: ir.Value | None) -> list[int] | None:
    """``value``'s dims, -1 for each symbolic one; None without a shape."""
    if value is None or value.shape is None:
        return None
    return [d if isinstance(d, int) else -1 for d in value.shape.dims]


def group_convs_as_kernels(graph: ir.Graph) -> list[str]:
    """Each Conv/ConvTranspose ``_group_convolution`` describes -> one ``TorchGroupConv_*`` node
    with its inputs. Returns the kernels' C units (one per distinct convolution)."""
    kernels = {}
    for node in list(graph):
        found = _group_convolution(node)
        if found is None:
            continue
        transposed, bias, *axes = found
        numbers = [transposed, bias, *(n for values in axes for n in values)]
        _window_kernel(graph, kernels, "TorchGroupConv_", "group_conv.h", "PW_GROUP_CONV", numbers, list(node.inputs),
                       node, node.outputs[0])
        graph.remove(node, safe=True)
    return list(kernels.values())


def _swaps_first_two(node: ir.Node | None) -> bool:
    """Whether ``node`` is a Transpose that swaps its first two axes and keeps the rest."""
    if not _op(node, "Transpose") or "perm" not in node.attributes:
        return False
    perm = [int(p) for p in node.attributes["perm"].value]
    return perm[:2] == [1, 0] and perm[2:] == list(range(2, len(perm)))


def _weight_gradient(node: ir.Node) -> tuple | None:
    """(input, output gradient, whether the Conv reads the input as it is (its first two axes
    swapped already), the value the kernel replaces, whether that is the Transpose after,
    spatial axes, strides, dilations, pads before, pads after) of a one-group float32 Conv with
    1 to 3 spatial axes: the form ``decompositions._conv_weight_grad`` writes a weight gradient
    in, Conv(Transpose(x), Transpose(gy)), each Transpose swapping the first two axes; else
    None. The kernel reads x and gy through those Transposes (where the graph gets x already
    swapped, a saved activation, it reads that). Where only such a Transpose reads the Conv, the
    kernel writes that layout (where the Conv's result is a graph output, PyTorch swaps the
    axes: a view)."""
    if not _op(node, "Conv") or len(node.inputs) != 2 or node.attributes.get_int("group", 1) != 1 \
            or not all(_is_float32(v) for v in node.inputs):
        return None
    x_swap, gy_swap = (v.producer() for v in node.inputs)
    if not _swaps_first_two(gy_swap):
        return None
    gy = gy_swap.inputs[0]
    # The input swapped already is a saved activation, a graph input. A 1x1 convolution's input
    # gradient, Conv(gy, Transpose(weight)), has that form too, and is not this product (K would
    # be its few channels: slower than ORT's Conv): its "gradient", the weight, is a graph input
    # with a 1x1 window, where a weight gradient's window is the layer's output.
    x_swapped = not _swaps_first_two(x_swap)
    x = node.inputs[0] if x_swapped else x_swap.inputs[0]
    if x_swapped and not (x.is_graph_input() and (gy.producer() is not None or gy.shape is None
                                                  or any(d != 1 for d in gy.shape.dims[2:]))):
        return None
    reader = _sole_user(node.outputs[0])
    swapped = _swaps_first_two(reader)
    replaced = reader.outputs[0] if swapped else node.outputs[0]
    rank = _rank(x)
    if rank is None or not 3 <= rank <= 5 or _rank(gy) != rank:
        return None
    spatial = rank - 2
    kept = [0] * spatial  # the taps computed per axis, 0: all
    while (cut := _first_rows_cut(_sole_user(replaced), rank)) is not None:
        kept = [k if c == 0 else c if k == 0 else min(k, c) for k, c in zip(kept, cut)]
        replaced = _sole_user(replaced).outputs[0]
    geometry = _conv_geometry(node, list(gy.shape.dims[2:]))
    if geometry is None:
        return None
    strides, before, after, dilations = geometry
    return x, gy, x_swapped, replaced, swapped, spatial, strides, dilations, before, after, kept


def _conv_geometry(node: ir.Node, window: list) -> tuple | None:
    """``_window_geometry`` of a Conv or ConvTranspose whose window is ``window`` (its weight's
    spatial dims, a symbolic one as its name), None also where its ``kernel_shape`` says
    another window."""
    stated = node.attributes.get_ints("kernel_shape", None)
    if stated is not None and list(stated) != [d if isinstance(d, int) else s for d, s in zip(window, stated)]:
        return None
    return _window_geometry(node.attributes, len(window))


def _first_rows_cut(node: ir.Node | None, rank: int) -> list[int] | None:
    """Per spatial axis of a ``rank``-axis tensor, the rows a Slice keeps (0: all) where
    ``node`` is a Slice that keeps the first rows of spatial axes only (the taps past a weight
    gradient's window: ``decompositions._conv_weight_grad``), else None."""
    if not _op(node, "Slice") or len(node.inputs) < 4:
        return None
    tensors = [_constant_tensor(v) for v in node.inputs[1:]]
    if any(t is None for t in tensors):
        return None
    starts, ends, axes, *steps = (t.numpy().reshape(-1).tolist() for t in tensors)
    if len(starts) != len(ends) or len(axes) != len(ends) or any(s != 0 for s in starts) \
            or any(s != 1 for s in (steps[0] if steps else [])):
        return None
    cut = [0] * (rank - 2)
    for axis, end in zip(axes, ends):
        axis = axis + rank if axis < 0 else axis
        if not 2 <= axis < rank or end < 1:
            return None
        cut[axis - 2] = end
    return cut


def conv_weight_grads_as_kernels(graph: ir.Graph, supported) -> list[str]:
    """Each convolution's weight gradient ``_weight_gradient`` describes -> one
    ``TorchConvWeightGrad_*`` node of the input and the output gradient (csrc/conv_weight_grad.h:
    one float32 product whose columns it reads from the input), its result the Transpose's.
    ``supported()``: as for the float32 products (the same blocking). Returns the C units."""
    found = [(node, match) for node in graph if (match := _weight_gradient(node)) is not None]
    if not found or not supported():
        return []
    kernels = {}
    for node, (x, gy, x_swapped, replaced, swapped, spatial, strides, dilations, before, after, kept) in found:
        axes = [values + [1] * (3 - spatial) for values in (strides, dilations)] \
            + [values + [0] * (3 - spatial) for values in (before, after, kept)]
        numbers = [spatial, int(x_swapped), int(swapped), *(n for values in axes for n in values)]
        _window_kernel(graph, kernels, "TorchConvWeightGrad_", "conv_weight_grad.h", "PW_CONV_WEIGHT_GRAD", numbers,
                       [x, gy], node, replaced)
        dead, value = [], replaced
        while value is not node.outputs[0]:  # the Slices and the Transpose, last first
            dead.append(value.producer())
            value = value.producer().inputs[0]
        _remove_if_dead(graph, [*dead, node, *(v.producer() for v in node.inputs if v.producer())])
    return list(kernels.values())


#: Input or output channels below which ORT's Conv stays: a stem's 3 input channels share the
#: kernel's per-tap work among too few rows (4.6 ms against 4.1 at ResNet's), and 3 output
#: channels would fill a quarter of the 12-row tile (benchmarks/convolution.py).
_MIN_CONV_CHANNELS = 8
_MIN_AXIS_SOFTMAX = 16384  # elements: below, ORT's ops as the pointwise stage leaves small groups


def _convolution(node: ir.Node) -> tuple | None:
    """(spatial axes, transposed, bias, strides, dilations, pads before, pads after) of a
    one-group float32 Conv with 1 to 3 spatial axes, or of a stride-1 ConvTranspose as the Conv
    by its flipped, swapped weight that it is (a stride-1 convolution's input gradient: its
    pads d (k - 1) less the ConvTranspose's, which must not exceed that), else None. Not a
    weight gradient's form, the weight the output gradient through a Transpose (conv_weight_grad.h's,
    or ORT's where that kernel declined it); not a 1x1 window (one product per image for ORT,
    1.6x faster than this kernel at MobileNet's 64 -> 192 channels), nor fewer than
    ``_MIN_CONV_CHANNELS`` input or output channels."""
    if not (_op(node, "Conv") or _op(node, "ConvTranspose")) or not 2 <= len(node.inputs) <= 3 \
            or node.attributes.get_int("group", 1) != 1 or not all(_is_float32(v) for v in node.inputs) \
            or _swaps_first_two(node.inputs[1].producer()) or "output_shape" in node.attributes:
        return None
    rank = _rank(node.inputs[0])
    if rank is None or not 3 <= rank <= 5 or _rank(node.inputs[1]) != rank:
        return None
    spatial = rank - 2
    kernel = list(node.inputs[1].shape.dims[2:])
    geometry = _conv_geometry(node, kernel)
    if geometry is None:
        return None
    strides, before, after, dilations = geometry
    transposed = node.op_type == "ConvTranspose"
    channels = [node.inputs[0].shape.dims[1], node.inputs[1].shape.dims[1 if transposed else 0]]  # in, out
    if all(k == 1 for k in kernel) or any(isinstance(c, int) and c < _MIN_CONV_CHANNELS for c in channels):
        return None
    if transposed:
        extra = list(node.attributes.get_ints("output_padding", [0] * spatial))
        if any(s != 1 for s in strides) or len(extra) != spatial or min(extra, default=0) < 0 \
                or not all(isinstance(k, int) for k in kernel):
            return None
        spans = [d * (k - 1) for d, k in zip(dilations, kernel)]
        before = [span - p for span, p in zip(spans, before)]
        after = [span - p + e for span, p, e in zip(spans, after, extra)]
        if min(before + after) < 0:
            return None
    return spatial, transposed, len(node.inputs) == 3, strides, dilations, before, after


def convs_as_kernels(graph: ir.Graph, supported) -> list[str]:
    """Each convolution ``_convolution`` describes (a Conv, or a stride-1 ConvTranspose) -> one
    ``TorchConv_*`` node of the same inputs (csrc/conv.h: one float32 product whose columns it
    reads from the input). ``supported()``: as for the float32 products (the same blocking).
    Returns the C units."""
    found = [(node, match) for node in graph if (match := _convolution(node)) is not None]
    if not found or not supported():
        return []
    kernels = {}
    for node, (spatial, transposed, bias, strides, dilations, before, after) in found:
        axes = [values + [1] * (3 - spatial) for values in (strides, dilations)] \
            + [values + [0] * (3 - spatial) for values in (before, after)]
        numbers = [spatial, int(transposed), int(bias), *(n for values in axes for n in values)]
        _window_kernel(graph, kernels, "TorchConv_", "conv.h", "PW_CONV", numbers, list(node.inputs), node,
                       node.outputs[0])
        graph.remove(node, safe=True)
    return list(kernels.values())


def scatter_adds_along_last_axis(graph: ir.Graph, constant_zeros, replace_node) -> int:
    """``ScatterElements(zeros, index, updates, axis=-1, reduction=add)``, float32, with
    ``index`` and ``updates`` shaped as the zeros but along the last axis (max pooling's
    gradient as ``decompositions`` writes it) -> ``ScatterAddLastAxis(shape, index, updates)``.
    ORT's ScatterElements takes each index through a generic loop on one thread. Zeros of
    symbolic shape (``dynamic=True``: an Expand of a zero, or a ConstantOfShape of zeros) hand
    the kernel the shape they are made from, read at run time."""
    count = 0
    for node in list(graph):
        if not _op(node, "ScatterElements") or len(node.inputs) != 3:
            continue
        data, index, updates = node.inputs
        if data is None or data.shape is None or index is None or updates is None:
            continue
        shape, rank = list(data.shape.dims), len(data.shape)
        if node.attributes.get_string("reduction", "none") != "add" or \
                node.attributes.get_int("axis", 0) not in (-1, rank - 1) or rank < 1 \
                or data.dtype != ir.DataType.FLOAT or updates.dtype != ir.DataType.FLOAT \
                or index.dtype != ir.DataType.INT64 or index.shape is None or updates.shape is None \
                or list(index.shape.dims) != list(updates.shape.dims) or list(index.shape.dims[:-1]) != shape[:-1]:
            continue
        if _static_dims(data) is not None:
            if constant_zeros(data) is None:
                continue
            dims = _int64_constant(graph, f"{node.outputs[0].name}_zeros_shape", shape)
        else:
            dims = _symbolic_zeros_shape(data)
            if dims is None:
                continue
        replace_node(graph, node, [ir.node("ScatterAddLastAxis", [dims, index, updates], domain=DOMAIN)], "elements")
        count += 1
    return count


def _symbolic_zeros_shape(zeros: ir.Value) -> ir.Value | None:
    """The shape ``zeros`` is made from, if it is an Expand of a zero that only ``shape`` sizes
    (its rank no higher) or a ConstantOfShape of zeros; else None."""
    node = zeros.producer()
    shape = _zeros_shape(node)
    if shape is not None and _op(node, "Expand") and len(_constant_tensor(node.inputs[0]).shape) > len(zeros.shape):
        return None  # the zero's own rank makes the result's: the shape alone does not
    return shape


def _static_dims(value: ir.Value | None) -> list[int] | None:
    if value is None or value.shape is None or not all(isinstance(d, int) for d in value.shape.dims):
        return None
    return list(value.shape.dims)


#: What a symbolic size counts as where a choice of kernel needs a number: Dynamo's symbolic
#: sizes are at least 2, and in practice a batch, a length or an image side. The kernels read
#: the sizes at run time, so this picks the faster path only; it cannot make a result wrong.
_SYMBOLIC_SIZE = 256


def _dims_for_choice(value: ir.Value | None) -> list[int] | None:
    """The value's sizes, a symbolic one as ``_SYMBOLIC_SIZE``; None if its rank is unknown
    or a dim is unnamed (it may be anything, 1 or 0 too)."""
    if value is None or value.shape is None:
        return None
    dims = []
    for d in value.shape.dims:
        if isinstance(d, int):
            dims.append(d)
        elif isinstance(d, ir.SymbolicDim) and d.value is not None:
            dims.append(_SYMBOLIC_SIZE)
        else:
            return None
    return dims


def _one_axis_moves(order: list[int]) -> bool:
    return any(order[:i] + order[i + 1:] == sorted(order[:i] + order[i + 1:]) for i in range(len(order)))


def _fewest_axes(dims: list[int], perm: list[int]) -> tuple[list[int], list[int]]:
    """(dims, perm) of the same move over the fewest axes: axes of size 1 dropped, and axes that
    stay neighbours merged into one (dims in the input's order)."""
    runs: list[list[int]] = []
    for axis in (axis for axis in perm if dims[axis] != 1):  # runs of consecutive input axes, output order
        if runs and axis == runs[-1][-1] + 1:
            runs[-1].append(axis)
        else:
            runs.append([axis])
    by_input = sorted(runs)
    return [math.prod(dims[axis] for axis in run) for run in by_input], [by_input.index(run) for run in runs]


def _moves_elementwise(dims: list[int], perm: list[int]) -> bool:
    """Whether ORT's Transpose is slower than ``TransposeRows`` here (benchmarks/transposes.py).
    Over the fewest axes (``_fewest_axes``: ORT's Transpose merges neighbours itself, and
    ``transposes_without_unit_axes`` takes out the axes of size 1): the innermost axis moves and
    so does more than one; or one axis moves and the output's rows are short (ORT's single-axis
    paths write those slowly); or the innermost axis stays but is shorter than ``_MIN_BLOCK``
    and more than one of the others moves (ORT copies it block by block; with one axis moving,
    its single-axis path copies even short blocks well)."""
    merged_dims, merged = _fewest_axes(dims, perm)
    if len(merged) < 3:
        return False
    innermost = merged_dims[merged[-1]]
    if merged[-1] == len(merged) - 1:
        return innermost < _MIN_BLOCK and not _one_axis_moves(merged[:-1])
    if _one_axis_moves(merged):
        return innermost <= _SHORT_ROW
    return True


def _bfloat16_moves_slowly(dims: list[int], perm: list[int]) -> bool:
    """Whether ORT's Transpose of a bfloat16 tensor is slower than ``TransposeRowsBf16``
    (benchmarks/transposes.py --bfloat16): where its float32 one is (``_moves_elementwise``),
    and also where the innermost axis stays innermost or only the last two axes swap
    (attention's heads and k: ORT's bfloat16 path copies those rows slower than its float32
    one does, 0.10-0.13 against 0.05-0.09 ms for [8, 128, 4, 64], half the bytes, in three
    runs). Where the innermost axis moves elsewhere (NHWC to NCHW), ORT's is the faster."""
    return _moves_elementwise(dims, perm) or perm[-1] == len(perm) - 1 or _swaps_last_two(perm) is True


def transpose_rows_kernel(bfloat16: bool) -> tuple[str, str]:
    """(op name, C unit) of the Transpose kernel for float32 or ``bfloat16`` tensors."""
    return ("TransposeRowsBf16", TRANSPOSE_ROWS_BF16) if bfloat16 else ("TransposeRows", TRANSPOSE_ROWS)


def slow_transposes_as_kernels(graph: ir.Graph) -> list[str]:
    """Transposes that ORT moves slowly -> ``TransposeRows``: float32 ones it
    would move element by element (``_moves_elementwise``), bfloat16 ones where its bfloat16
    path is the slower (``_bfloat16_moves_slowly``). Run after the pointwise groups: a
    Transpose that only a group reads, the group reads at its strides instead. Returns the
    kernels' C units."""
    units = []
    for node in list(graph):
        if node.op_type != "Transpose" or node.domain not in ("", "ai.onnx"):
            continue
        x = node.inputs[0]
        dims = _dims_for_choice(x)
        perm = list(node.attributes.get_ints("perm", []))
        bfloat16 = element_type(x, _VIEWS) == ir.DataType.BFLOAT16
        if dims is None or not 3 <= len(dims) <= 8 or sorted(perm) != list(range(len(dims))) \
                or not (bfloat16 or _is_float32(x)) or math.prod(dims) < _MIN_TRANSPOSED \
                or not (_bfloat16_moves_slowly(dims, perm) if bfloat16 else _moves_elementwise(dims, perm)) \
                or any(use.node.op_type in _READS_TRANSPOSED for use in node.outputs[0].uses()):
            continue
        name, unit = transpose_rows_kernel(bfloat16)
        kernel = ir.node(name, [x, _int64_constant(graph, f"{node.outputs[0].name}_perm", perm)], domain=DOMAIN)
        graph.insert_before(node, kernel)
        _take_over(node.outputs[0], kernel.outputs[0])
        kernel.outputs[0].dtype = ir.DataType.BFLOAT16 if bfloat16 else ir.DataType.FLOAT
        graph.remove(node, safe=True)
        units.append(unit)
    return list(dict.fromkeys(units))


#: Elements from which a Transpose is worth a Squeeze and an Unsqueeze around it: ORT's
#: element-by-element path took 8.1 us for 256 floats against 8.5 as a 3-D Transpose between
#: two views, 15.6 against 12.3 for 2048 (one-node sessions; a view costs ORT about 0.4 us).
_MIN_UNIT_FREE = 1024


def transposes_without_unit_axes(graph: ir.Graph, add_nodes: bool = True) -> int:
    """Transposes that move an axis of size 1 -> a Squeeze of such axes, the Transpose of the
    rest, and an Unsqueeze putting them back (symbolic sizes too); one Reshape where only axes
    of size 1 move (static sizes: no copy then). ORT's Transpose moves element by element
    whenever its innermost axis moves, even one of size 1, as torch's einsum leaves them
    (XLNet's [4, 4, 64, 1, 32] by [2, 0, 1, 4, 3]: 238 us, 48 us without the axis of size 1).
    Run last: the passes before match Transposes by their perm. Left as they are: Transposes a
    product reads (ORT folds those into FusedMatMul) and, unless ``add_nodes``, those that
    would become more nodes. Returns how many changed."""
    count = 0
    for node in list(graph):
        x = node.inputs[0] if _op(node, "Transpose") and node.inputs else None
        dims = _dims_for_choice(x)
        perm = list(node.attributes.get_ints("perm", [])) if x is not None else []
        if dims is None or sorted(perm) != list(range(len(dims))) or 1 not in dims \
                or any(use.node.op_type in _READS_TRANSPOSED for use in node.outputs[0].uses()):
            continue
        kept = [axis for axis in perm if dims[axis] != 1]
        moves = kept != sorted(kept)
        static = _static_dims(x) is not None
        if (moves or not static) and (not add_nodes or math.prod(dims) < _MIN_UNIT_FREE):
            continue
        name = node.outputs[0].name

        def add(op_type, inputs, attributes=None):
            new = ir.node(op_type, inputs, attributes=attributes or {})
            graph.insert_before(node, new)
            new.outputs[0].dtype = x.dtype
            return new.outputs[0]

        if static and not moves:
            value = add("Reshape", [x, _int64_constant(graph, f"{name}_dims", [dims[axis] for axis in perm])])
        else:
            units = [axis for axis, d in enumerate(dims) if d == 1]
            value = add("Squeeze", [x, _int64_constant(graph, f"{name}_units", units)])
            if moves:
                value = add("Transpose", [value], {"perm": [sorted(kept).index(axis) for axis in kept]})
            at = [i for i, axis in enumerate(perm) if dims[axis] == 1]
            value = add("Unsqueeze", [value, _int64_constant(graph, f"{name}_unit_at", at)])
        _take_over(node.outputs[0], value)
        graph.remove(node, safe=True)
        count += 1
    return count


#: ORT CPU ops that broadcast their operands elementwise (the ones ``one_element_operands_at_full_rank`` fixes).
_BROADCASTING = {"Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Mod", "PRelu", "Where", "Equal", "Less",
                 "LessOrEqual", "Greater", "GreaterOrEqual", "And", "Or", "Xor", "BitShift"}


def one_element_operands_at_full_rank(graph: ir.Graph) -> int:
    """A one-element constant operand with fewer axes than an elementwise op's result whose last
    axis has size 1 (a norm's statistics [8, 128, 1], a pooler's [N, C, 1, 1]) -> the same value
    with the result's rank ([1, 1, 1]). ORT's CPU broadcasting goes through such a result one
    element at a time: Mul of [8, 320, 1, 1] by a scalar 22 us, by a [1, 1, 1, 1] 4.1 (Pow
    46 and 4.7, Where 69 and 5.1: ``benchmarks/broadcasts.py``). Not where the last axis is
    longer: there a scalar is already ORT's fast case (Where over [1024, 64]: 23 us either way). The values are
    the same, but for Pow by 2 or 3: the element-by-element path calls powf, ORT's others
    multiply, as eager does, so there the rewrite gives eager's values (powf was 1 ulp off for
    some). Returns how many operands changed."""
    count, made = 0, {}
    for node in graph:
        if node.op_type not in _BROADCASTING or node.domain not in ("", "ai.onnx"):
            continue
        shapes = [v.shape if v is not None else None for v in node.inputs]
        if any(s is None for s in shapes):
            continue
        rank = max(len(s) for s in shapes)
        if rank < 2 or any(len(s) and s[-1] != 1 for s in shapes):
            continue
        for index, value in enumerate(node.inputs):
            tensor = _constant_tensor(value) if len(shapes[index]) < rank else None
            if tensor is None or tensor.size != 1:
                continue
            if (value, rank) not in made:
                name = f"{value.name or 'one_element'}_rank{rank}_{len(made)}"
                made[value, rank] = _initializer(graph, name, tensor.numpy().reshape([1] * rank))
            node.replace_input_with(index, made[value, rank])
            count += 1
    return count


def slow_expands_as_products(graph: ir.Graph) -> int:
    """Float32 Expands that broadcast the last axis -> a MatMul by a row of ones, then an
    Expand of the other axes if any: ORT's Expand fills such a result a few elements at a time
    (0.65 ms for 800K floats: a mean's gradient, adaptive pooling's), a product of inner size 1
    takes a twentieth of that, and an Expand that copies whole rows is fast. The row covers
    every trailing axis of size 1 in ``x`` (a pooled plane's 7 x 7 at once). Each element is
    ``x * 1``: exactly ``x``, infinities and NaN included. Run after the pointwise groups, which
    read a broadcast input in place. Returns how many were replaced."""
    count = 0
    for node in list(graph):
        if not _op(node, "Expand") or len(node.inputs) != 2:
            continue
        x, shape = node.inputs
        out = node.outputs[0]
        if x is None or shape is None or x.shape is None or out.shape is None or not _is_float32(x) \
                or len(out.shape) == 0 or (len(x.shape) and x.shape[-1] != 1) or out.shape[-1] == 1:
            continue
        sizes = _dims_for_choice(out)
        if sizes is None or math.prod(sizes) < _MIN_TRANSPOSED:
            continue
        kept = len(x.shape)  # x's leading axes, before its trailing run of size-1 axes
        while kept and x.shape[kept - 1] == 1:
            kept -= 1
        spread_axes = len(x.shape) - kept if len(x.shape) else len(out.shape)  # a scalar's: all
        spread_dims = out.shape.dims[len(out.shape) - spread_axes:]
        name = out.name

        def add(op_type, inputs, **attributes):
            new = ir.node(op_type, inputs, attributes=attributes)
            graph.insert_before(node, new)
            return new.outputs[0]

        def constant(suffix, values):
            return _int64_constant(graph, f"{name}_{suffix}", values)

        trailing = None
        if not all(isinstance(d, int) for d in spread_dims):  # their sizes from the shape at run time
            # (after 1s: a shape shorter than the axes spread leaves x's 1s there, as broadcasting does)
            padded = add("Concat", [constant("ones", [1] * len(spread_dims)), shape], axis=0)
            trailing = add("Slice", [padded, constant("from", [-len(spread_dims)]), constant("to", [_INT64_MAX])])
        column = x
        if kept != len(x.shape) - 1:  # (a scalar too: kept 0)
            column = add("Reshape", [x, constant("column", [0] * kept + [1])])
        if trailing is None:
            ones = _initializer(graph, f"{name}_ones", np.ones((1, math.prod(spread_dims)), dtype=np.float32))
        else:
            length = add("ReduceProd", [trailing, constant("axis", [0])], keepdims=1)
            ones = add("ConstantOfShape", [add("Concat", [constant("one", [1]), length], axis=0)],
                       value=ir.tensor(np.ones(1, dtype=np.float32)))
        spread = add("MatMul", [column, ones])
        if len(spread_dims) > 1:  # the row back into its axes (0: keep that leading axis)
            if trailing is None:
                target = constant("spread", [0] * kept + list(spread_dims))
            else:
                target = add("Concat", [constant("kept", [0] * kept), trailing], axis=0) if kept else trailing
            spread = add("Reshape", [spread, target])
        if not _same_dims(x.shape.dims[:kept], out.shape.dims[:len(out.shape) - len(spread_dims)]):
            spread = add("Expand", [spread, shape])
        spread.dtype = ir.DataType.FLOAT
        _take_over(out, spread)
        graph.remove(node, safe=True)
        count += 1
    return count


def _same_dims(a, b) -> bool:
    """Whether two runs of dims are the same sizes at every run: equal ints or named symbols."""
    known = _named_dims(a)
    return known is not None and known == _named_dims(b)


#: The heads' order of attention ([batch, heads, sequence, depth] -> [batch, sequence, heads, depth]).
_HEADS_TO_ROWS = [0, 2, 1, 3]


def merge_heads_kernel(inputs: int, bfloat16: bool) -> tuple[str, str]:
    """(op name, C unit) of the kernel merging attention's heads back into rows (csrc/pointwise.h,
    ``pw_merge_heads``), float32 or ``bfloat16`` (``...Bf16``): ``MergeHeads`` for one input (a
    Transpose), ``ConcatHeads<n>`` for ``inputs`` > 1 (their Concat along the last axis)."""
    name = ("MergeHeads" if inputs == 1 else f"ConcatHeads{inputs}") + ("Bf16" if bfloat16 else "")
    kind = "PW_BF16" if bfloat16 else "PW_FLOAT"
    return name, "\n".join([
        '#include "pointwise.h"',
        f"static const int {name}_types[] = {{{', '.join([kind] * inputs)}}};",
        f"static const int {name}_out[] = {{{kind}}};",
        f"static const int {name}_none[] = {{0}};",
        f"PW_KERNEL({name}, {inputs}, {name}_types, {name}_none, 1, {name}_none, 0, 0, 0, 0, pw_merge_heads, 0, "
        f"{name}_out);",
    ]) + "\n"


def moves_heads(dims: list, perm: list[int]) -> bool:
    """Whether a Transpose of x of ``dims`` by ``perm`` is ``MergeHeads``' (``merged_heads_as_kernels``):
    [B, H, S, D] -> [B, S, H, D], H and D known, rows of D long enough to copy whole."""
    return list(perm) == _HEADS_TO_ROWS and len(dims) == 4 and isinstance(dims[1], int) \
        and isinstance(dims[3], int) and dims[3] >= _MIN_BLOCK


def _swaps_heads(node: ir.Node | None) -> bool:
    """Whether ``node`` is a Transpose [0, 2, 1, 3]: attention's heads into rows or out of them."""
    return _op(node, "Transpose") and list(node.attributes.get_ints("perm", [])) == _HEADS_TO_ROWS


def _heads_to_rows(transpose: ir.Node | None) -> ir.Value | None:
    """x where ``transpose`` is ``MergeHeads``' Transpose (``moves_heads``) of float32 or bfloat16
    x; else None."""
    if not _op(transpose, "Transpose"):
        return None
    x = transpose.inputs[0]
    if x is None or x.shape is None or element_type(x, _BF16_VIEWS) not in _HEAD_TYPES:
        return None
    return x if moves_heads(list(x.shape.dims), list(transpose.attributes.get_ints("perm", []))) else None


def _concatenated_heads(value: ir.Value) -> ir.Value | None:
    """x where ``value``, read only by one Concat, is ``Reshape(Transpose(x, [0, 2, 1, 3]))`` of x
    [B, H, S, D] to [B, S, H * D], the Transpose read only by that Reshape; else None."""
    reshape = value.producer()
    if not _op(reshape, "Reshape") or _sole_user(value) is None or value.shape is None or value.shape.rank() != 3:
        return None
    moved = reshape.inputs[0]
    x = _heads_to_rows(moved.producer()) if moved is not None else None
    if x is None or _sole_user(moved) is None:
        return None
    batch, heads, seq, depth = x.shape.dims
    out = value.shape.dims
    return x if out[0] == batch and out[1] == seq and out[2] == heads * depth else None


def merged_heads_as_kernels(graph: ir.Graph) -> list[str]:
    """Attention's heads moved back into rows (a Transpose [0, 2, 1, 3] of [B, H, S, D]) ->
    ``MergeHeads``, one pass of row copies where ORT's Transpose is slower
    (benchmarks/transposes.py); and a Concat along the last axis of such moves, each reshaped to
    [B, S, H * D] (GPT-2's q, k and v gradients, for its one projection), which ORT runs as a
    Transpose per input and a Concat -> ``ConcatHeads<n>``, one pass. Returns the kernels' C units."""
    units = []
    concats = [n for n in graph if _op(n, "Concat")]  # first: their inputs' Transposes are theirs
    for node in concats + [n for n in graph if _op(n, "Transpose")]:
        if node.graph is None:
            continue
        if _op(node, "Concat"):
            if node.attributes.get_int("axis", 0) not in (-1, 2) or len(node.inputs) < 2:
                continue
            sources = [_concatenated_heads(v) if v is not None else None for v in node.inputs]
            if None in sources or len({element_type(x, _BF16_VIEWS) for x in sources}) != 1:
                continue
            removed = [v.producer() for v in node.inputs]
        else:
            x = _heads_to_rows(node)
            if x is None or any(use.node.op_type in _READS_TRANSPOSED for use in node.outputs[0].uses()):
                continue
            sources, removed = [x], []
        name, unit = merge_heads_kernel(len(sources), element_type(sources[0], _BF16_VIEWS) == ir.DataType.BFLOAT16)
        kernel = ir.node(name, sources, domain=DOMAIN)
        graph.insert_before(node, kernel)
        _take_over(node.outputs[0], kernel.outputs[0])
        graph.remove(node, safe=True)
        for reshape in removed:
            transpose = reshape.inputs[0].producer()
            _remove_if_dead(graph, [reshape, transpose])
        units.append(unit)
    return list(dict.fromkeys(units))


def split_heads_kernel(outputs: int, bias: bool) -> tuple[str, str]:
    """(op name, C unit) of the kernel splitting one projection into ``outputs`` parts in heads'
    layout (csrc/pointwise.h, ``pw_split_heads``), plus the projection's ``bias``:
    ``SplitHeads<n>``, ``SplitHeads<n>Bias``."""
    name = f"SplitHeads{outputs}{'Bias' if bias else ''}"
    types = ["PW_FLOAT", "PW_INT64"] + (["PW_FLOAT"] if bias else [])
    return name, "\n".join([
        '#include "pointwise.h"',
        f"static const int {name}_types[] = {{{', '.join(types)}}};",
        f"static const int {name}_none[] = {{{', '.join(['0'] * max(len(types), outputs))}}};",
        f"PW_KERNEL({name}, {len(types)}, {name}_types, {name}_none, {outputs}, {name}_none, 0, 0, 0, 0, "
        "pw_split_heads);",
    ]) + "\n"


def _part_into_heads(part: ir.Value, batch, seq) -> tuple[int, int, ir.Value | None, list[ir.Node]] | None:
    """(H, D, bias or None, the chain's nodes) where ``part`` [B, S, H * D], read only by it, goes
    ``Reshape`` to [B, S, H, D], optionally ``Add`` of a bias of [H, D] (``bias_after_reshape``
    put it there), and ``Transpose`` [0, 2, 1, 3] into [B, H, S, D]; else None."""
    reshape = _sole_user(part)
    if not _op(reshape, "Reshape") or reshape.inputs[0] is not part:
        return None
    shaped = reshape.outputs[0]
    if shaped.shape is None or shaped.shape.rank() != 4:
        return None
    b, s, heads, depth = shaped.shape.dims
    if not (b == batch and s == seq and isinstance(heads, int) and isinstance(depth, int) and depth >= _MIN_BLOCK):
        return None
    chain, bias, moved = [reshape], None, _sole_user(shaped)
    if _op(moved, "Add"):
        other = moved.inputs[1] if moved.inputs[0] is shaped else moved.inputs[0]
        if other is None or other.shape is None or list(other.shape.dims) != [heads, depth] \
                or not _is_float32(other):
            return None
        chain, bias, moved = chain + [moved], other, _sole_user(moved.outputs[0])
    return (heads, depth, bias, chain + [moved]) if _swaps_heads(moved) else None


def _whole_bias(graph: ir.Graph, before: ir.Node, parts: list[ir.Value]) -> ir.Value:
    """The projection's bias [W] whose pieces ``parts`` ([H_i, D_i] each) are: where they are
    views of the pieces of one Split of it (``bias_after_reshape`` splits GPT-2's), that bias
    (the Split and views left to go dead); else the pieces flattened and concatenated, before
    ``before``."""
    sources = []
    for part in parts:
        view = part.producer()
        piece = view.inputs[0] if _op(view, "Reshape") else None
        sources.append(piece.producer() if piece is not None else None)
    split = sources[0]
    if _op(split, "Split") and all(s is split for s in sources) \
            and [p.producer().inputs[0] for p in parts] == list(split.outputs) \
            and split.inputs[0] is not None and split.inputs[0].shape is not None and split.inputs[0].shape.rank() == 1:
        return split.inputs[0]
    flat = _int64_constant(graph, f"{parts[0].name}_flat", [-1])
    views = [ir.node("Reshape", [part, flat]) for part in parts]
    whole = ir.node("Concat", [v.outputs[0] for v in views], attributes={"axis": 0})
    for node in views + [whole]:
        graph.insert_before(before, node)
    whole.outputs[0].dtype = ir.DataType.FLOAT
    return whole.outputs[0]


def split_heads_as_kernels(graph: ir.Graph) -> list[str]:
    """One projection of q, k and v (GPT-2's ``c_attn``, GPT-NeoX's, Falcon's) split along its last
    axis, each part viewed as heads, plus its bias, and moved into [B, H, S, D] -> ``SplitHeads``:
    one pass over the projection, where ORT makes a Split and, per part, a kernel that adds the
    bias into heads' layout. Float32. Run before the pointwise groups form (they would take the
    Adds and Transposes). Returns the kernels' C units."""
    units = []
    for split in [n for n in graph if _op(n, "Split")]:
        x = split.inputs[0]
        if x is None or x.shape is None or x.shape.rank() != 3 or not _is_float32(x) \
                or split.attributes.get_int("axis", 0) not in (-1, 2) or len(split.outputs) < 2:
            continue
        batch, seq, width = x.shape.dims
        parts = [_part_into_heads(v, batch, seq) for v in split.outputs]
        if None in parts or len({bias is None for _, _, bias, _ in parts}) != 1 \
                or sum(h * d for h, d, _, _ in parts) != width:
            continue
        biased = parts[0][2] is not None
        sizes = _int64_constant(graph, f"{split.outputs[0].name}_heads_sizes", [[h, d] for h, d, _, _ in parts])
        name, unit = split_heads_kernel(len(parts), biased)
        bias = _whole_bias(graph, split, [b for _, _, b, _ in parts]) if biased else None
        kernel = ir.node(name, [x, sizes] + ([bias] if biased else []), domain=DOMAIN, num_outputs=len(parts))
        graph.insert_before(split, kernel)
        for out, (_, _, bias_part, chain) in zip(kernel.outputs, parts):
            _take_over(chain[-1].outputs[0], out)
            for node in reversed(chain):
                graph.remove(node, safe=True)
            view = bias_part.producer() if bias_part is not None else None
            if view is not None:
                _remove_if_dead(graph, [n for n in (view, view.inputs[0].producer() if view.inputs else None) if n])
        graph.remove(split, safe=True)
        units.append(unit)
    return list(dict.fromkeys(units))


#: Ops that only reshape or reorder a value: a bfloat16 value seen through them still is one.
_BF16_VIEWS = frozenset({"Reshape", "Transpose", "Unsqueeze", "Squeeze", "Identity", "Flatten"})


def _bfloat16_source(value: ir.Value | None) -> tuple[ir.Value, list[ir.Node]] | None:
    """(v, views) where float32 ``value`` is ``views(Cast(v))`` of a bfloat16 ``v`` (the views
    in order from ``v``), else None: a value that holds bfloat16 values."""
    views = []
    while value is not None and value.dtype in (ir.DataType.FLOAT, None):
        producer = value.producer()
        if producer is None or producer.domain not in ("", "ai.onnx"):
            return None
        if producer.op_type == "Cast":
            source = producer.inputs[0]
            if source is None or source.dtype != ir.DataType.BFLOAT16 \
                    or producer.attributes.get_int("to", 0) != ir.DataType.FLOAT:
                return None
            return source, views[::-1]
        if producer.op_type not in _BF16_VIEWS:
            return None
        views.append(producer)
        value = producer.inputs[0]
    return None


def _in_bfloat16(graph: ir.Graph, source: tuple[ir.Value, list[ir.Node]], before: ir.Node) -> ir.Value:
    """A value that holds bfloat16 values, given as its ``_bfloat16_source``, as a bfloat16
    tensor: its views taken of the bfloat16 value it was widened from, so that the product
    reads half the bytes, and the kernel that rounds that value need not also write it widened."""
    x, views = source
    for view in views:
        step = ir.node(view.op_type, [x, *view.inputs[1:]], attributes=dict(view.attributes))
        step.outputs[0].dtype, step.outputs[0].shape = ir.DataType.BFLOAT16, view.outputs[0].shape
        graph.insert_before(before, step)
        x = step.outputs[0]
    return x


def _rounded_to_bfloat16(value: ir.Value) -> bool:
    """Whether everything that reads ``value`` rounds it to bfloat16, directly or after adding
    a bias (``_pointwise._bias_into_rounding``'s form of a Linear): an autocast product."""
    def rounds(node: ir.Node) -> bool:
        return _op(node, "Cast") and node.attributes.get_int("to", 0) == ir.DataType.BFLOAT16

    uses = value.uses()
    if value.is_graph_output() or not uses:
        return False
    for use in uses:
        node = use.node
        bias = node.inputs[1] if _op(node, "Add") and len(node.inputs) == 2 and node.inputs[0] is value else None
        if _rank(bias) == 1 and not node.outputs[0].is_graph_output():
            if not node.outputs[0].uses() or not all(rounds(u.node) for u in node.outputs[0].uses()):
                return False
        elif not rounds(node):
            return False
    return True


def _swaps_last_two(perm: list[int]) -> bool | None:
    """True if ``perm`` swaps the last two axes and keeps the others, False if it keeps every
    axis, None otherwise: the composed Transposes a product folds in."""
    rank = len(perm)
    if perm == list(range(rank)):
        return False
    return True if perm == [*range(rank - 2), rank - 1, rank - 2] else None


def _through_transposes(value: ir.Value, rank: int) -> tuple[ir.Value, bool]:
    """(the value the Transposes after ``value`` make, whether they swap its last two axes):
    through each Transpose that is all that reads the value before it, as far as they compose
    to a swap of the last two axes or to nothing (a weight's gradient is often ``t(t(g))``);
    else (``value``, False)."""
    found, perm = (value, False), list(range(rank))
    while len(value.uses()) == 1 and not value.is_graph_output() and _op(value.uses()[0].node, "Transpose"):
        after = list(value.uses()[0].node.attributes.get_ints("perm", []))
        if sorted(after) != list(range(rank)):
            break
        perm = [perm[axis] for axis in after]
        value = value.uses()[0].node.outputs[0]
        if (swapped := _swaps_last_two(perm)) is not None:
            found = (value, swapped)
    return found


def _without_transposes(value: ir.Value, rank: int) -> tuple[ir.Value, bool]:
    """(what ``value`` is a transpose of, whether its last two axes are swapped): through the
    Transposes before it that, composed, swap the last two axes or nothing (a weight's
    gradient often reads ``t(t(w))``); else ``value`` itself."""
    found, base, perm = (value, False), value, list(range(rank))
    while _op(base.producer(), "Transpose"):
        before = list(base.producer().attributes.get_ints("perm", []))
        if sorted(before) != list(range(rank)):
            break
        perm = [before[axis] for axis in perm]
        base = base.producer().inputs[0]
        if (swapped := _swaps_last_two(perm)) is not None:
            found = (base, swapped)
    return found


def _rank(value: ir.Value | None) -> int | None:
    return None if value is None or value.shape is None else len(value.shape)


def _widened(value: ir.Value) -> list[ir.Node] | None:
    """The Casts to float32 that are all that reads bfloat16 ``value``, else None."""
    readers = [use.node for use in value.uses()]
    if value.is_graph_output() or not readers or not all(
            _op(n, "Cast") and n.attributes.get_int("to", 0) == ir.DataType.FLOAT for n in readers):
        return None
    return readers


def _result_form(result: ir.Value) -> tuple[str, list[ir.Value], ir.Value | None]:
    """How a bfloat16 product writes ``result`` (a MatMul's float32 output that is rounded to
    bfloat16, ``_rounded_to_bfloat16``), the values it then replaces, and the bias it adds
    first (a Linear's, ``_pointwise._bias_into_rounding``'s Add), if any. Forms: "b" bfloat16,
    the rounding Casts' outputs; "r" float32 holding the rounded values, the outputs of the
    Casts back to float32 that are all that reads them (no bfloat16 tensor is written); "f"
    the float32 sums, ``result`` itself (its readers are not all Casts, or a bias is added in
    some but not all)."""
    readers, bias, sums = [use.node for use in result.uses()], None, result
    add = readers[0] if len(readers) == 1 and _op(readers[0], "Add") else None
    if add is not None and add.inputs[0] is result and _rank(add.inputs[1]) == 1 \
            and add.inputs[1].dtype == ir.DataType.FLOAT and not add.outputs[0].is_graph_output():
        bias, sums = add.inputs[1], add.outputs[0]
        # The kernel adds one value per output column: a bias of another or unknown length
        # (baddbmm's broadcast [1]) stays an Add.
        columns = bias.shape.dims[0] if bias.shape is not None else None
        width = result.shape.dims[-1] if result.shape is not None and len(result.shape.dims) else None
        if not isinstance(columns, int) or columns != width:
            return "f", [result], None
        readers = [use.node for use in sums.uses()]
    if not readers or not all(_op(n, "Cast") for n in readers):
        return "f", [result], None
    rounded = [n.outputs[0] for n in readers]
    widening = [_widened(v) for v in rounded]
    form, targets = ("r", [n.outputs[0] for ns in widening for n in ns]) if all(widening) else ("b", rounded)
    if len(targets) > 1 and any(v.is_graph_output() for v in targets):
        return "f", [result], None
    return form, targets, bias


def bf16_matmul_kernel(transposed: list[bool], bfloat16: list[bool], rounded: bool, bias: bool) -> tuple[str, str]:
    """(op name, C unit) of a bfloat16 product (csrc/bf16_gemm.h): A and B ``transposed`` in
    their last two axes or not; A, B and C held as ``bfloat16`` or as float32; a float32 C
    ``rounded`` to bfloat16 values or the plain sums; a third input, a ``bias``, or not."""
    name = f"Bf16MatMul{_layout(transposed)}_{''.join('b' if b else 'f' for b in bfloat16)}" \
        + ("r" if rounded else "") + ("_bias" if bias else "")
    types = ", ".join("PW_BF16" if b else "PW_FLOAT" for b in bfloat16)
    return name, _product_unit(name, f"PW_BF16_MATMUL({name}, {int(transposed[0])}, {int(transposed[1])}, "
                                     f"{types}, {int(rounded)})", bias)


def f32_matmul_kernel(transposed: list[bool], bias: bool) -> tuple[str, str]:
    """(op name, C unit) of a float32 product of ort_dynamo's own (csrc/bf16_gemm.h's blocking
    with FMA): A and B ``transposed`` in their last two axes or not; a third input, a ``bias``,
    or not. Built where the compiler targets AVX-512 (``_kernels.float32_products``); ``f32_matmuls_as_kernels``
    says where it replaces ORT's (``benchmarks/gemm.py --ours`` compares the two)."""
    name = f"F32MatMul{_layout(transposed)}" + ("_bias" if bias else "")
    return name, _product_unit(name, f"PW_F32_MATMUL({name}, {int(transposed[0])}, {int(transposed[1])})", bias)


def _layout(transposed: list[bool]) -> str:
    return "".join("T" if t else "N" for t in transposed)


def _product_unit(name: str, definition: str, bias: bool) -> str:
    """The C unit of one product op of csrc/bf16_gemm.h: its macro ``definition``, its kernel line."""
    return "\n".join([
        '#include "bf16_gemm.h"',
        definition + ";",
        f"PW_KERNEL({name}, {3 if bias else 2}, {name}_types, {name}_none, 1, {name}_none, 0, 0, 0, 0, "
        f"{name}_compute, 0, {name}_out_types);",
    ]) + "\n"


#: The shortest inner dimension our float32 product takes: at K=1024 it beat ORT's (A's rows in
#: memory), at K=256 it did not (``benchmarks/gemm.py --ours``).
F32_MIN_K = 512
F32_MIN_M = 512


def _few_rows(a: ir.Value, b: ir.Value) -> bool:
    """Whether the product of ``a`` by ``b`` is known to have fewer than ``F32_MIN_M`` rows per
    matrix (``a``'s leading axes are rows too where ``b`` is one matrix)."""
    dims = list(a.shape.dims[:-1]) if _rank(b) == 2 else [a.shape[-2]]
    return all(isinstance(d, int) for d in dims) and math.prod(dims) < F32_MIN_M


#: At most this many rows (known, B one matrix): csrc/bf16_gemm.h's path for few rows, which
#: reads B in place and splits its columns over the threads (an RNN's step: 16 rows against its
#: recurrent weight), where ORT's product packs all of B for each call (``gemm.py --skinny``).
F32_SKINNY_M = 32
#: ... and at least this long an inner dimension and this many columns, both known: smaller
#: products take microseconds either way.
F32_SKINNY_MIN_KN = 64


def _skinny(a: ir.Value, b: ir.Value) -> bool:
    """Whether the product of ``a`` by ``b`` is known to have at most ``F32_SKINNY_M`` rows,
    ``b`` one matrix (its rows are then all of ``a``'s leading axes), and K and N of at least
    ``F32_SKINNY_MIN_KN``."""
    dims = list(a.shape.dims[:-1])
    inner_and_columns = [a.shape[-1], b.shape[-1]] if _rank(b) == 2 else []
    return bool(inner_and_columns) and all(isinstance(d, int) for d in dims + inner_and_columns) \
        and 0 < math.prod(dims) <= F32_SKINNY_M and min(inner_and_columns) >= F32_SKINNY_MIN_KN


def f32_matmuls_as_kernels(graph: ir.Graph, supported) -> list[str]:
    """Each float32 MatMul whose inner dimension is static and at least ``F32_MIN_K``, A's rows in
    memory (not a Transpose's) and not known to be fewer than ``F32_MIN_M``, or with few rows
    (``_skinny``) -> ``F32MatMulN{N,T}``, a Transpose of B's last two axes folded in. Where A is
    transposed (weight gradients) ORT's product was as fast; with 64 to 256 rows ORT's was
    1.1-1.9x faster (a convolution's weight gradient as columns, ``gemm.py``'s shapes at M=256).
    ``supported()``: whether the compiler targets AVX-512 (``_kernels.float32_products``). Returns the kernels' C units."""
    found = []
    for node in graph:
        if not (_op(node, "MatMul") and len(node.inputs) == 2
                and all(v is not None and v.dtype == ir.DataType.FLOAT and (_rank(v) or 0) >= 2 for v in node.inputs)):
            continue
        a, b = node.inputs
        inner = a.shape[-1]
        long_inner = isinstance(inner, int) and inner >= F32_MIN_K and not _few_rows(a, b)
        if not (long_inner or _skinny(a, b)) or _without_transposes(a, _rank(a))[1]:
            continue
        found.append(node)
    if not found or not supported():
        return []
    kernels = {}
    for node in found:
        a, b = node.inputs
        operand, swapped = _without_transposes(b, _rank(b))
        name, unit = f32_matmul_kernel([False, swapped], False)
        kernels[name] = unit
        product = ir.node(name, [a, operand], domain=DOMAIN)
        graph.insert_before(node, product)
        _take_over(node.outputs[0], product.outputs[0])
        product.outputs[0].dtype = ir.DataType.FLOAT
        _remove_if_dead(graph, [node, *_chain_before(b)])
    return list(kernels.values())


def blas_products(graph: ir.Graph, domain: str, bfloat16: bool) -> int:
    """Each MatMul whose second operand is one matrix or a batch of the first's batch shape
    (attention's products written out: XLNet's einsums, T5's, GPT-J's), and each Gemm (alpha 1, a
    bias of one value per output column if any), of float32 values -> ``domain``'s MatMul
    (csrc/torch_blas.c: torch's BLAS); of two bfloat16 values widened (CPU autocast's products),
    where ``bfloat16``, -> its Bf16MatMul, which reads them as bfloat16 and writes the float32
    sums the MatMul did. Batches that broadcast stay ORT's.
    Transposes of the operands' last two axes are folded in, and a Transpose of the result's (a
    weight gradient's) done by multiplying the operands the other way round. Returns the count."""
    count = 0
    for node in list(graph):
        if _op(node, "MatMul") and len(node.inputs) == 2:
            a, b = node.inputs
            bias, trans, alpha = None, (False, False), 1.0
        elif _op(node, "Gemm") and len(node.inputs) >= 2:
            a, b = node.inputs[:2]
            bias = node.inputs[2] if len(node.inputs) > 2 else None
            trans = (bool(node.attributes.get_int("transA", 0)), bool(node.attributes.get_int("transB", 0)))
            alpha = node.attributes.get_float("alpha", 1.0)
            if bias is not None and (node.attributes.get_float("beta", 1.0) != 1.0 or not _per_column(bias, b, trans[1])):
                continue
        else:
            continue
        batched = (_rank(b) or 0) > 2
        if alpha != 1.0 or not all(_is_float32(v) for v in (a, b, bias) if v is not None) \
                or _rank(a) is None or _rank(a) < 2 or (_rank(b) or 0) < 2 \
                or (batched and (_rank(a) != _rank(b) or list(a.shape.dims[:-2]) != list(b.shape.dims[:-2]))):
            continue
        operands, transposed, sources = [], [], []
        for value, flag in zip((a, b), trans):
            operand, swapped = _without_transposes(value, _rank(value))
            source = _bfloat16_source(operand)
            if source is not None and not source[1]:  # widened where it is read: its Transposes are bfloat16's
                base, swapped_before = _without_transposes(source[0], _rank(value))
                source, swapped = (base, []), swapped != swapped_before
            operands.append(operand)
            transposed.append(flag != swapped)
            sources.append(source)
        if any(sources) and not (bfloat16 and all(sources)):
            continue  # one bfloat16 operand: the bfloat16 kernels' case
        if all(sources):
            operands = [_in_bfloat16(graph, source, node) for source in sources]
        target = node.outputs[0]
        if bias is None and _rank(a) == 2:
            value, swapped = _through_transposes(target, 2)
            if swapped:  # (A B)^T = B^T A^T
                target = value
                operands, transposed = operands[::-1], [not t for t in transposed[::-1]]
        replaced = [*_chain_before(target), node, *(n for v in (a, b) for n in _chain_before(v))]
        product = ir.node("Bf16MatMul" if all(sources) else "MatMul", [*operands, *([bias] if bias is not None else [])],
                          domain=domain, attributes={"trans_a": int(transposed[0]), "trans_b": int(transposed[1])})
        product.metadata_props.update(node.metadata_props)  # where in the model it came from (save_onnx)
        graph.insert_before(node, product)
        _take_over(target, product.outputs[0])
        product.outputs[0].dtype = ir.DataType.FLOAT
        _remove_if_dead(graph, replaced)
        count += 1
    return count


def _per_column(bias: ir.Value, b: ir.Value, b_transposed: bool) -> bool:
    """Whether a Gemm's ``bias`` is known to be one value per column of its result ([N], [1, N])."""
    columns = b.shape[0 if b_transposed else 1] if _rank(b) == 2 else None
    dims = list(bias.shape.dims) if bias.shape is not None else None
    return isinstance(columns, int) and dims in ([columns], [1, columns])


def bf16_matmuls_as_kernels(graph: ir.Graph, supported) -> list[str]:
    """Each MatMul of two bfloat16 values whose result is rounded to bfloat16 (CPU autocast's
    products, ``rewrite._compute_bfloat16_in_float32``) -> ``Bf16MatMul{N,T}{N,T}_{a}{b}{c}``:
    a Transpose of an operand's last two axes folded in, the operands read as bfloat16, the
    rounding done as the result is stored (``_result_form``), and a Transpose of the result's
    last two axes (a weight gradient's) done by multiplying the operands the other way round.
    ``supported()`` (asked only if there is one) says whether the compiler targets AVX512-BF16.
    Returns the kernels' C units."""
    found = []
    for node in graph:
        if _op(node, "MatMul") and len(node.inputs) == 2 and all(_bfloat16_source(v) for v in node.inputs) \
                and all((_rank(v) or 0) >= 2 for v in node.inputs) and _rounded_to_bfloat16(node.outputs[0]):
            found.append(node)
    if not found or not supported():
        return []
    kernels = {}
    for node in found:
        operands, transposed = [], []
        for value in node.inputs:
            operand, swapped = _without_transposes(value, _rank(value))
            source = _bfloat16_source(operand)  # None: another product's float32 result
            operands.append(_in_bfloat16(graph, source, node) if source else operand)
            transposed.append(swapped)
        result = node.outputs[0]
        form, targets, bias = _result_form(result)
        rank = max(_rank(v) for v in node.inputs)  # the result's (the exporter may leave it unset)
        if form != "f" and bias is None and len(targets) == 1 and not targets[0].is_graph_output():
            value, swapped = _through_transposes(targets[0], rank)
            if value is not targets[0]:
                targets = [value]
            if swapped:  # (A B)^T = B^T A^T: the product written in the layout the Transposes make
                operands, transposed = operands[::-1], [not t for t in transposed[::-1]]
        types = [v.dtype == ir.DataType.BFLOAT16 for v in operands] + [form == "b"]
        name, unit = bf16_matmul_kernel(transposed, types, form == "r", bias is not None)
        kernels[name] = unit
        # What the product replaces, each reader before what it reads: the Casts and Transposes
        # after the MatMul, the bias's Add, the MatMul, the views and Casts before it.
        replaced = [*(n for v in targets for n in _chain_before(v)), *(use.node for use in result.uses()), node,
                    *(n for v in node.inputs for n in _chain_before(v))]
        product = ir.node(name, [*operands, *([bias] if bias is not None else [])], domain=DOMAIN)
        graph.insert_before(node, product)
        out = product.outputs[0]
        targets = sorted(targets, key=lambda v: not v.is_graph_output())  # at most one is
        _take_over(targets[0], out)
        for other in targets[1:]:
            other.replace_all_uses_with(out)
        out.dtype = ir.DataType.BFLOAT16 if form == "b" else ir.DataType.FLOAT
        _remove_if_dead(graph, replaced)
        if form == "b":
            _reshape_before_widening(graph, out)
    return list(kernels.values())


def _reshape_before_widening(graph: ir.Graph, value: ir.Value) -> None:
    """``Reshape(Cast(value, to=float))`` -> ``Cast(Reshape(value))`` for bfloat16 ``value``
    (a product's result that something also reads as bfloat16): the Reshape, free either way,
    moves before the Cast, which then joins the kernel that reads the reshaped value instead
    of being a pass of ORT's over the whole tensor. Through consecutive Reshapes."""
    pending = [use.node for use in value.uses()]
    while pending:
        cast = pending.pop()
        value = cast.inputs[0] if cast.inputs else None
        if not _op(cast, "Cast") or cast.attributes.get_int("to", 0) != ir.DataType.FLOAT \
                or cast.outputs[0].is_graph_output():
            continue
        readers = [u.node for u in cast.outputs[0].uses()]
        if not readers or not all(_op(r, "Reshape") for r in readers):
            continue
        for reshape in readers:
            viewed = ir.node("Reshape", [value, *reshape.inputs[1:]], attributes=dict(reshape.attributes))
            widened = ir.node("Cast", [viewed.outputs[0]], attributes={"to": ir.DataType.FLOAT})
            viewed.outputs[0].dtype, viewed.outputs[0].shape = ir.DataType.BFLOAT16, reshape.outputs[0].shape
            widened.outputs[0].shape = reshape.outputs[0].shape
            graph.insert_before(reshape, [viewed, widened])
            _take_over(reshape.outputs[0], widened.outputs[0])
            widened.outputs[0].dtype = ir.DataType.FLOAT
            graph.remove(reshape, safe=True)
            pending.append(widened)
        graph.remove(cast, safe=True)


def _chain_before(value: ir.Value) -> list[ir.Node]:
    """The views and Casts that made ``value``, back to the first other op."""
    chain = []
    while _op(value.producer(), "Cast") or (value.producer() is not None and value.producer().domain in ("", "ai.onnx")
                                            and value.producer().op_type in _BF16_VIEWS):
        chain.append(value.producer())
        value = value.producer().inputs[0]
    return chain
