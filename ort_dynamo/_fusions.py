"""Fusions of exported ONNX chains into ONNX Runtime's fused CPU kernels.

ORT's own graph optimizer misses the chains torchlib emits at opset 18 for erf-GELU, tanh-GELU
and RMSNorm (operand orders differ from its patterns). Each fusion here replaces a chain only
where every interior value is used once and is not a graph output: in a training forward graph
the values autograd saves for backward are graph outputs, and they must stay computed.
Fusions only ever add kernels ORT has on CPU (stock ORT is inference-only: no gradient ops).
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np
import onnx_ir as ir

__all__ = ["FUSIONS", "fuse"]

_MS = "com.microsoft"


# -- small matching helpers -----------------------------------------------------------------------

def _named_dims(dims) -> tuple | None:
    """Sizes as static ints and named symbols (their names); None if any is unknown."""
    out = []
    for d in dims:
        if isinstance(d, int):
            out.append(d)
        elif isinstance(d, ir.SymbolicDim) and d.value is not None:
            out.append(str(d.value))
        else:
            return None
    return tuple(out)


def _constant_tensor(value: ir.Value | None):
    """The tensor of an initializer or of a Constant node's ``value``, else None."""
    if value is None or value.const_value is not None:
        return value.const_value if value is not None else None
    producer = value.producer()
    if producer is None or producer.op_type != "Constant" or "value" not in producer.attributes:
        return None
    return producer.attributes["value"].value


def _scalar(value: ir.Value | None) -> float | None:
    """The value of a one-element constant (initializer or Constant node), else None."""
    tensor = _constant_tensor(value)
    if tensor is None:
        return None
    array = tensor.numpy()
    return float(array.reshape(-1)[0]) if array.size == 1 else None


def _is(value: ir.Value | None, number: float, rel: float = 1e-4) -> bool:
    got = _scalar(value)
    return got is not None and math.isclose(got, number, rel_tol=rel)


def _sole_user(value: ir.Value) -> ir.Node | None:
    """The one node reading ``value`` when nothing else (graph output, other node) needs it."""
    if value.is_graph_output():
        return None
    uses = value.uses()
    if len(uses) != 1:
        return None
    return uses[0].node


def _op(node: ir.Node | None, op_type: str) -> bool:
    return node is not None and node.op_type == op_type and node.domain in ("", "ai.onnx")


def _zeros_shape(node: ir.Node | None) -> ir.Value | None:
    """The shape ``node`` fills with zeros, if it is a ConstantOfShape of 0 or an Expand of a
    constant 0; else None."""
    if _op(node, "ConstantOfShape"):
        fill = node.attributes["value"].value.numpy() if "value" in node.attributes else np.zeros(1)
        return None if fill.any() else node.inputs[0]
    if _op(node, "Expand") and _scalar(node.inputs[0]) == 0.0:
        return node.inputs[1]
    return None


def _ints(value: ir.Value | None) -> list[int] | None:
    """The integers of a constant (initializer or Constant node), else None."""
    producer = value.producer() if value is not None and value.const_value is None else None
    if producer is not None and producer.op_type == "Constant" and "value_ints" in producer.attributes:
        return [int(x) for x in producer.attributes["value_ints"].value]
    tensor = _constant_tensor(value)
    return None if tensor is None else [int(x) for x in tensor.numpy().reshape(-1)]


def _perm_keeping_last_axis(node: ir.Node) -> list[int] | None:
    """A standard Transpose's perm if it leaves the last axis last (rows move whole), else None."""
    if node.op_type != "Transpose" or node.domain not in ("", "ai.onnx") or "perm" not in node.attributes:
        return None
    perm = [int(p) for p in node.attributes["perm"].value]
    return perm if perm and perm[-1] == len(perm) - 1 else None


def _other(node: ir.Node, value: ir.Value) -> ir.Value | None:
    """For a binary op, the input that is not ``value`` (None if ``value`` is not one of two)."""
    a, b = (list(node.inputs) + [None, None])[:2]
    if a is value:
        return b
    if b is value:
        return a
    return None


def softmax_written_out(peak: ir.Node) -> bool:
    """Whether ``peak`` is the ReduceMax of a softmax written out, with its row's logsumexp
    (``lower._AttentionRecomputed`` keeps it for backward): ReduceMax, Sub, Exp, ReduceSum,
    Div, and Log of the sum added to the max, nothing else reading the max, the differences
    or the exponentials. There a max that passes over NaN (ORT's, the pointwise kernels')
    gives torch's results: a row holding NaN has a NaN sum, which every result reads."""
    axes = _ints(peak.inputs[1]) if _op(peak, "ReduceMax") and len(peak.inputs) == 2 else None
    if axes is None:
        return False
    x, top = peak.inputs[0], peak.outputs[0]
    shifts = [u.node for u in top.uses() if _op(u.node, "Sub") and u.idx == 1 and u.node.inputs[0] is x]
    if len(shifts) != 1 or top.is_graph_output():
        return False
    shifted = shifts[0].outputs[0]
    exps = [u.node for u in shifted.uses()]
    if len(exps) != 1 or not _op(exps[0], "Exp") or shifted.is_graph_output():
        return False
    exp = exps[0].outputs[0]
    sums = [u.node for u in exp.uses() if _op(u.node, "ReduceSum") and u.idx == 0 and len(u.node.inputs) == 2
            and _ints(u.node.inputs[1]) == axes]
    if len(sums) != 1 or exp.is_graph_output():
        return False
    total = sums[0].outputs[0]
    divides = [u.node for u in exp.uses() if _op(u.node, "Div") and u.idx == 0 and u.node.inputs[1] is total]
    if len(exp.uses()) != 1 + len(divides):
        return False
    logs = [u.node for u in total.uses() if _op(u.node, "Log")]
    adds = [u.node for log in logs for u in log.outputs[0].uses() if _op(u.node, "Add") and top in u.node.inputs]
    return all(u.node in (*shifts, *adds) for u in top.uses())


def _is_float32(value: ir.Value | None) -> bool:
    return value is not None and value.dtype == ir.DataType.FLOAT


def element_type(value: ir.Value | None, through: frozenset) -> ir.DataType | None:
    """``value``'s element type, read through the ``through`` ops (which keep their first input's
    type) before it where the exporter left it unset: values of inlined torchlib functions."""
    while value is not None and value.dtype is None:
        producer = value.producer()
        if producer is None or producer.op_type not in through:
            return None
        value = producer.inputs[0]
    return None if value is None else value.dtype


def _half_x_tail(start: ir.Value, x: ir.Value) -> list[ir.Node] | None:
    """Match ``start * x * 0.5`` in any grouping torchlib and users write:
    ``x * (0.5 * start)``, ``(0.5 * x) * start``, ``(x * start) * 0.5``, ...
    Returns the Mul nodes, the last one producing the result; None if it does not match."""
    needed = {"x", "half"}
    nodes: list[ir.Node] = []
    current = start
    while needed:
        mul = _sole_user(current)
        if not _op(mul, "Mul"):
            return None
        other = _other(mul, current)
        if other is None:
            return None
        if other is x and "x" in needed:
            needed.discard("x")
        elif "half" in needed and _is(other, 0.5):
            needed.discard("half")
        elif needed == {"x", "half"} and _op(other.producer(), "Mul") and _sole_user(other) is mul:
            half_x = other.producer()  # 0.5 * x computed on its own branch
            rest = _other(half_x, x)
            if rest is None or not _is(rest, 0.5):
                return None
            nodes.append(half_x)
            needed.clear()
        else:
            return None
        nodes.append(mul)
        current = mul.outputs[0]
    return nodes


def _replace(graph: ir.Graph, old: list[ir.Value], new_node: ir.Node, before: ir.Node) -> None:
    """Insert ``new_node`` before ``before``; its outputs take over ``old`` (names included,
    since graph outputs are fetched by name). The orphaned chain is left to dead-code removal."""
    graph.insert_before(before, new_node)
    for old_value, new_value in zip(old, new_node.outputs):
        if old_value is not None:
            _take_over(old_value, new_value)


def _remove_if_dead(graph: ir.Graph, nodes) -> None:
    """Remove those of ``nodes`` (in order) that are still in ``graph`` and read by nothing."""
    for node in nodes:
        if node.graph is not None and not any(v.uses() or v.is_graph_output() for v in node.outputs):
            graph.remove(node, safe=True)


def _take_over(old: ir.Value, new: ir.Value, suffix: str = "unfused",
               output_positions: dict[ir.Value, int] | None = None) -> None:
    """``new`` replaces ``old`` everywhere, graph outputs and name included; ``old`` keeps its
    name plus ``suffix``. ``output_positions`` (graph output -> index, kept up to date here)
    saves onnx_ir's scan of every graph output, which an optimizer step's thousands of outputs
    make quadratic."""
    name, old.name = old.name, f"{old.name}_{suffix}"
    new.name = name
    if old.dtype is not None:  # values inside inlined torchlib functions carry no type
        new.dtype = old.dtype
    new.shape = old.shape
    if output_positions is not None and old in output_positions:
        at = output_positions.pop(old)
        old.graph.outputs[at] = new
        output_positions[new] = at
    old.replace_all_uses_with(new, replace_graph_outputs=True)


def _initializer(graph: ir.Graph, name: str, array: np.ndarray) -> ir.Value:
    """A new initializer of ``graph`` holding ``array``, with its dtype and shape."""
    tensor = ir.tensor(array)
    value = ir.Value(name=name, shape=ir.Shape(list(array.shape)), type=ir.TensorType(tensor.dtype),
                     const_value=tensor)
    graph.register_initializer(value)
    return value


def _int64_constant(graph: ir.Graph, name: str, values) -> ir.Value:
    """A new int64 initializer of ``graph`` (shapes, axes)."""
    return _initializer(graph, name, np.asarray(values, dtype=np.int64))


# -- fusions --------------------------------------------------------------------------------------

def fuse_erf_gelu(graph: ir.Graph) -> int:
    """``x * 0.5 * (1 + Erf(x / sqrt(2)))`` -> com.microsoft ``Gelu(x)`` (one pass, not five)."""
    count = 0
    for erf in [n for n in graph if _op(n, "Erf")]:
        scale = erf.inputs[0].producer()
        if _sole_user(erf.inputs[0]) is not erf or scale is None or len(scale.inputs) != 2:
            continue
        if _op(scale, "Div") and _is(scale.inputs[1], math.sqrt(2)):
            x = scale.inputs[0]
        elif _op(scale, "Mul") and _is(scale.inputs[1], math.sqrt(0.5)):
            x = scale.inputs[0]
        elif _op(scale, "Mul") and _is(scale.inputs[0], math.sqrt(0.5)):
            x = scale.inputs[1]
        else:
            continue
        count += _fuse_gelu_tail(graph, x, erf, "Gelu")
    return count


#: tanh-GELU's constants: ``0.5 * x * (1 + tanh(BETA * (x + KAPPA * x**3)))``.
_TANH_GELU_BETA, _TANH_GELU_KAPPA = math.sqrt(2 / math.pi), 0.044715


def fuse_tanh_gelu(graph: ir.Graph) -> int:
    """``0.5 * x * (1 + Tanh(sqrt(2/pi) * (x + 0.044715 * x**3)))`` -> com.microsoft
    ``FastGelu(x)``. Matches in inference graphs; a training forward saves Tanh for backward."""
    count = 0
    for tanh in [n for n in graph if _op(n, "Tanh")]:
        outer = tanh.inputs[0].producer()
        if not _op(outer, "Mul") or _sole_user(tanh.inputs[0]) is not tanh:
            continue
        inner = next((v for v in outer.inputs if v is not None and not _is(v, _TANH_GELU_BETA)), None)
        if inner is None or not any(_is(v, _TANH_GELU_BETA) for v in outer.inputs) or _sole_user(inner) is not outer:
            continue
        add = inner.producer()
        if not _op(add, "Add"):
            continue
        x = None
        for candidate in add.inputs:
            cubic = _other(add, candidate)
            mul = cubic.producer() if cubic is not None else None
            if not _op(mul, "Mul") or _sole_user(cubic) is not add:
                continue
            power = next((v for v in mul.inputs if not _is(v, _TANH_GELU_KAPPA)), None)
            if power is None or not any(_is(v, _TANH_GELU_KAPPA) for v in mul.inputs):
                continue
            pow_node = power.producer()
            if _op(pow_node, "Pow") and pow_node.inputs[0] is candidate and _is(pow_node.inputs[1], 3.0) \
                    and _sole_user(power) is mul:
                x = candidate
                break
        if x is not None:
            count += _fuse_gelu_tail(graph, x, tanh, "FastGelu")
    return count


def _fuse_gelu_tail(graph: ir.Graph, x: ir.Value, core: ir.Node, fused_op: str) -> int:
    """Shared end of both GELUs: ``core(...) + 1`` then times ``x`` and 0.5."""
    if not _is_float32(x):
        return 0
    add = _sole_user(core.outputs[0])
    if not _op(add, "Add") or not _is(_other(add, core.outputs[0]), 1.0):
        return 0
    tail = _half_x_tail(add.outputs[0], x)
    if tail is None:
        return 0
    result = tail[-1].outputs[0]
    _replace(graph, [result], ir.node(fused_op, [x], domain=_MS), before=tail[-1])
    return 1


def fuse_rms_norm(graph: ir.Graph) -> int:
    """RMSNorm's ``x * 1/Sqrt(ReduceMean(x**2, -1) + eps)`` -> ``SimplifiedLayerNormalization``
    (ORT's ONNX-domain kernel), whose 2nd output is the inverse RMS autograd saves."""
    count = 0
    ones: dict[int, ir.Value] = {}
    for mean in [n for n in graph if _op(n, "ReduceMean")]:
        square = mean.inputs[0].producer()
        if _sole_user(mean.inputs[0]) is not mean:
            continue
        if _op(square, "Pow") and _is(square.inputs[1], 2.0):
            x = square.inputs[0]
        elif _op(square, "Mul") and square.inputs[0] is square.inputs[1]:
            x = square.inputs[0]
        else:
            continue
        if not _is_float32(x) or x.shape is None or not isinstance(x.shape[-1], int):
            continue
        rank = len(x.shape)
        axes_value = mean.inputs[1] if len(mean.inputs) > 1 else None
        axes = axes_value.const_value.numpy().reshape(-1).tolist() \
            if axes_value is not None and axes_value.const_value is not None else None
        if axes is None and "axes" in mean.attributes:
            axes = list(mean.attributes["axes"].value)
        keepdims = mean.attributes["keepdims"].value if "keepdims" in mean.attributes else 1
        if axes not in ([-1], [rank - 1]) or keepdims != 1:
            continue
        add = _sole_user(mean.outputs[0])
        if not _op(add, "Add"):
            continue
        eps = _scalar(_other(add, mean.outputs[0]))
        sqrt = _sole_user(add.outputs[0])
        if eps is None or not _op(sqrt, "Sqrt"):
            continue
        recip = _sole_user(sqrt.outputs[0])
        if not _op(recip, "Reciprocal"):
            continue
        inv_rms = recip.outputs[0]
        normalize = next((u.node for u in inv_rms.uses() if _op(u.node, "Mul") and _other(u.node, inv_rms) is x),
                         None)
        if normalize is None:  # nothing to gain without the full-size product
            continue
        hidden = x.shape[-1]
        if hidden not in ones:
            ones[hidden] = _initializer(graph, f"rms_norm_ones_{hidden}", np.ones(hidden, dtype=np.float32))
        fused = ir.node("SimplifiedLayerNormalization", [x, ones[hidden]], num_outputs=2,
                        attributes={"axis": -1, "epsilon": eps, "stash_type": 1})
        # Reciprocal comes after x and before every reader of either result.
        _replace(graph, [normalize.outputs[0], inv_rms], fused, before=recip)
        count += 1
    return count


def drop_pow_one(graph: ir.Graph) -> int:
    """``Pow(x, 1)`` -> ``x``. Autograd's derivative of ``x**2`` is ``2 * x**1``, and ORT's Pow
    has no fast path for exponent 1: it costs ~10x a Mul (llama's RMSNorm backward)."""
    count = 0
    for power in [n for n in graph if _op(n, "Pow")]:
        x, exponent = power.inputs[0], power.inputs[1]
        result = power.outputs[0]
        if x is None or not _is(exponent, 1.0, rel=0) or x.dtype != result.dtype:
            continue
        if result.is_graph_output():
            # ORT hands each graph output its own buffer: keep a (cheap) copy.
            _replace(graph, [result], ir.node("Identity", [x]), before=power)
        else:
            result.replace_all_uses_with(x)
        count += 1
    return count


def bias_after_reshape(graph: ir.Graph) -> int:
    """``Reshape(Gemm(a, b, bias))`` feeding elementwise work, a GELU or a head-splitting
    Transpose -> ``Reshape(MatMul(a, b)) + bias``. ORT's Gemm adds a bias by first broadcasting
    it over its whole output (about 1 ms of a 3 ms [1024, 1024] product on two cores); added
    after the Reshape, the bias is one pass (0.25 ms there), or joins what follows: a pointwise
    kernel (the residual add), ORT's BiasGelu where the sum is not saved for backward, or the
    pointwise kernel that writes the sum in the Transpose's layout (attention's q, k and v:
    the Transpose's own pass goes too). Chains of Reshapes are followed (``[T, H] -> [B, S, H]
    -> [B, S, heads, d]``), the bias reshaped to the trailing dimensions it covers, and so is
    a Split of the last axis (GPT-2's fused q/k/v projection), each piece taking its slice of
    the bias. Where the Gemm's result is saved, the saved value is the sum reshaped back (a
    free view: ``rewrite`` hands Reshape outputs to PyTorch as views)."""
    count = 0
    for gemm in [n for n in graph if _op(n, "Gemm")]:
        a, b, bias = (list(gemm.inputs) + [None] * 3)[:3]
        result = gemm.outputs[0]
        attributes = {name: gemm.attributes[name].value for name in gemm.attributes}
        if bias is None or not _is_float32(result) or bias.shape is None or len(bias.shape) != 1 \
                or not isinstance(bias.shape[0], int) \
                or attributes.get("transA", 0) or attributes.get("transB", 0) \
                or attributes.get("alpha", 1.0) != 1.0 or attributes.get("beta", 1.0) != 1.0 \
                or result.shape is None or not all(isinstance(d, int) for d in result.shape) \
                or len(result.uses()) != 1 or not _op(result.uses()[0].node, "Reshape"):
            continue
        first = result.uses()[0].node
        last = _last_reshape(first)
        site = _bias_site(last, bias.shape[0])
        sites, split = ([site], None) if site is not None else (None, _split_of_last_axis(last.outputs[0]))
        if split is not None and not result.is_graph_output():
            split_node, sizes = split
            sites = [_bias_site(_last_reshape(piece.uses()[0].node), size)
                     if len(piece.uses()) == 1 and not piece.is_graph_output() and _op(piece.uses()[0].node, "Reshape")
                     else None for piece, size in zip(split_node.outputs, sizes)]
        if not sites or None in sites:
            continue
        product = ir.node("MatMul", [a, b])
        graph.insert_before(gemm, product)
        product.outputs[0].dtype, product.outputs[0].shape = result.dtype, result.shape
        first.replace_input_with(0, product.outputs[0])
        biases = [bias]
        if split is not None:  # each piece its slice of the bias, split as the product is
            given = split_node.inputs[1] if len(split_node.inputs) > 1 else None
            sliced = ir.node("Split", [bias] if given is None else [bias, given], num_outputs=len(sizes),
                             attributes={"axis": 0} if given is not None else {"axis": 0, "num_outputs": len(sizes)})
            graph.insert_before(gemm, sliced)
            for piece, size in zip(sliced.outputs, sizes):
                piece.dtype, piece.shape = bias.dtype, ir.Shape([size])
            biases = list(sliced.outputs)
        for (reshape, dims), piece in zip(sites, biases):
            added = _add_bias_after(graph, reshape, piece, dims)
        if result.is_graph_output():  # saved for backward: the sum, shaped as the Gemm's result
            target = _int64_constant(graph, f"{result.name}_shape", list(result.shape))
            back = ir.node("Reshape", [added, target])
            graph.insert_after(added.producer(), back)
            _take_over(result, back.outputs[0], "gemm")
        graph.remove(gemm, safe=True)
        count += 1
    return count


def _bias_site(reshape: ir.Node, size: int) -> tuple[ir.Node, list[int]] | None:
    """(Reshape, bias dims) where a bias of ``size`` can be added after ``reshape`` at less
    cost than Gemm's; None if it cannot."""
    reshaped = reshape.outputs[0]
    dims = _covering_suffix(reshaped.shape, size)
    if dims is None or not reshaped.uses() or not all(_adds_bias_cheaply(use.node) for use in reshaped.uses()):
        return None
    return reshape, dims


def _add_bias_after(graph: ir.Graph, reshape: ir.Node, bias: ir.Value, dims: list[int]) -> ir.Value:
    """``reshape``'s output + ``bias`` (reshaped to ``dims``); the sum takes the output's place,
    name included (it may be a saved activation). Returns the sum."""
    reshaped = reshape.outputs[0]
    if len(dims) > 1:  # [H] -> [heads, d]: broadcasts over [B, S, heads, d]
        shaped = ir.node("Reshape", [bias, _int64_constant(graph, f"{reshaped.name}_bias_shape", dims)])
        graph.insert_after(reshape, shaped)
        shaped.outputs[0].dtype, shaped.outputs[0].shape = bias.dtype, ir.Shape(dims)
        bias, reshape = shaped.outputs[0], shaped
    add = ir.node("Add", [reshaped, bias])
    graph.insert_after(reshape, add)
    _take_over(reshaped, add.outputs[0], "without_bias")
    add.replace_input_with(0, reshaped)
    return add.outputs[0]


def _split_of_last_axis(value: ir.Value) -> tuple[ir.Node, list[int]] | None:
    """(Split, piece sizes) when ``value``'s only reader splits its last axis into known sizes."""
    uses = value.uses()
    if value.is_graph_output() or len(uses) != 1 or not _op(uses[0].node, "Split") or value.shape is None:
        return None
    split = uses[0].node
    rank, last = len(value.shape), value.shape[-1]
    axis = split.attributes["axis"].value if "axis" in split.attributes else 0
    if axis not in (-1, rank - 1) or not isinstance(last, int):
        return None
    if len(split.inputs) > 1 and split.inputs[1] is not None:
        sizes = _ints(split.inputs[1])
        if sizes is None:
            return None
    else:
        pieces = split.attributes["num_outputs"].value if "num_outputs" in split.attributes else 0
        if not pieces or last % pieces:
            return None
        sizes = [last // pieces] * pieces
    return (split, sizes) if sum(sizes) == last and len(sizes) == len(split.outputs) else None


def _last_reshape(reshape: ir.Node) -> ir.Node:
    """The last of a chain of Reshapes each only the next one reads (static shapes)."""
    while True:
        out = reshape.outputs[0]
        uses = out.uses()
        if out.is_graph_output() or len(uses) != 1 or not _op(uses[0].node, "Reshape") \
                or uses[0].node.outputs[0].shape is None:
            return reshape
        reshape = uses[0].node


def _covering_suffix(shape: ir.Shape | None, size: int) -> list[int] | None:
    """The trailing dimensions of ``shape`` whose product is ``size`` (a bias's length):
    ``[8, 128, 4, 64]`` and 256 -> ``[4, 64]``; None if no static suffix has that product."""
    if shape is None:
        return None
    dims, product = [], 1
    for d in reversed(list(shape)):
        if not isinstance(d, int) or product >= size:
            break
        product *= d
        dims.insert(0, d)
    return dims if product == size and dims else None


def _adds_bias_cheaply(node: ir.Node) -> bool:
    """A reader of the product next to which a separate bias Add costs less than Gemm's
    broadcast: it fuses with it (elementwise ops, GELU), or it is a Transpose keeping the last
    axis, which the pointwise kernel of the Add writes in place of the Transpose's own pass."""
    if node.domain == _MS:
        return node.op_type in ("Gelu", "FastGelu")
    if node.domain not in ("", "ai.onnx"):
        return False
    if node.op_type == "Transpose":
        return _perm_keeping_last_axis(node) is not None
    return node.op_type in ("Add", "Mul", "Sub", "Div", "Identity")


def _slice_parts(node: ir.Node) -> tuple[list[int], list[int], list[int], list[int]] | None:
    """(starts, ends, axes, steps) of a Slice whose inputs are constants, axes made non-negative."""
    inputs = list(node.inputs) + [None] * (5 - len(node.inputs))
    starts, ends = _ints(inputs[1]), _ints(inputs[2])
    if starts is None or ends is None or len(starts) != len(ends):
        return None
    axes = list(range(len(starts))) if inputs[3] is None else _ints(inputs[3])
    steps = [1] * len(starts) if inputs[4] is None else _ints(inputs[4])
    if axes is None or steps is None or len(axes) != len(starts) or len(steps) != len(starts):
        return None
    if any(axis < 0 for axis in axes):
        shape = node.inputs[0].shape
        if shape is None:
            return None
        axes = [axis % len(shape) for axis in axes]
    return starts, ends, axes, steps


def merge_slices(graph: ir.Graph) -> int:
    """A Slice of a Slice along other axes -> one Slice: one pass over the data, not two (a
    strided ``x[:, :, ::2, ::2]``, which torch writes as a slice per axis: the pixels a
    stride-2 1x1 convolution's weight gradient reads)."""
    count = 0
    for outer in list(graph):
        if not _op(outer, "Slice"):
            continue
        inner = outer.inputs[0].producer() if outer.inputs[0] is not None else None
        if not _op(inner, "Slice") or _sole_user(inner.outputs[0]) is not outer:
            continue
        first, second = _slice_parts(inner), _slice_parts(outer)
        if first is None or second is None or set(first[2]) & set(second[2]):
            continue
        starts, ends, axes, steps = (a + b for a, b in zip(first, second))
        name = outer.outputs[0].name
        merged = ir.node("Slice", [inner.inputs[0], *(_int64_constant(graph, f"{name}_{part}", values)
                                                      for part, values in (("starts", starts), ("ends", ends),
                                                                           ("axes", axes), ("steps", steps)))])
        _replace(graph, [outer.outputs[0]], merged, before=outer)
        count += 1
    return count


#: Name -> fusion, in the order applied. Each returns how many chains it replaced.
def drop_unread_pool_indices(graph: ir.Graph) -> int:
    """A MaxPool whose Indices nothing reads, with that output dropped: ORT then pools in its
    blocked layout (NCHWc); with Indices declared it computes them in a generic loop, read or
    not. torchlib's ``max_pool2d`` declares them (its results come from the indices variant), and
    so does the NaN lookup of ``lowerings/core._nan_as_torch``."""
    count = 0
    for node in list(graph):
        if (node.op_type != "MaxPool" or node.domain not in ("", "ai.onnx") or len(node.outputs) != 2
                or node.outputs[1].uses() or node.outputs[1].is_graph_output()):
            continue
        _replace(graph, [node.outputs[0]], ir.node("MaxPool", list(node.inputs), attributes=node.attributes),
                 before=node)
        count += 1
    return count


FUSIONS: dict[str, Callable[[ir.Graph], int]] = {
    "erf_gelu": fuse_erf_gelu,
    "tanh_gelu": fuse_tanh_gelu,
    "rms_norm": fuse_rms_norm,
    "pow_one": drop_pow_one,
    "bias_after_reshape": bias_after_reshape,
    "pool_indices": drop_unread_pool_indices,
    "slices": merge_slices,
}


def fuse(model: ir.Model) -> dict[str, int]:
    """Apply every fusion to ``model``'s main graph; return the count per fusion."""
    # Dead nodes still read their inputs, and the fusions count readers: dead ones (left by
    # export, constant folding, or a fusion that replaced a chain: GPT-2's tanh-GELU left
    # Pow/Add/Mul on a Linear's output) must not stop one.
    remove_dead = ir.passes.common.RemoveUnusedNodesPass()
    remove_dead(model)
    counts = {}
    for name, fusion in FUSIONS.items():
        counts[name] = fusion(model.graph)
        if counts[name]:
            remove_dead(model)
    if any(counts.values()) and _MS not in model.opset_imports:
        model.opset_imports[_MS] = 1
    return counts
