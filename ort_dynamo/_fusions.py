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

def _scalar(value: ir.Value | None) -> float | None:
    """The value of a one-element constant (initializer or Constant node), else None."""
    if value is None:
        return None
    tensor = value.const_value
    if tensor is None:
        producer = value.producer()
        if producer is None or producer.op_type != "Constant" or "value" not in producer.attributes:
            return None
        tensor = producer.attributes["value"].value
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


def _other(node: ir.Node, value: ir.Value) -> ir.Value | None:
    """For a binary op, the input that is not ``value`` (None if ``value`` is not one of two)."""
    a, b = (list(node.inputs) + [None, None])[:2]
    if a is value:
        return b
    if b is value:
        return a
    return None


def _is_float32(value: ir.Value | None) -> bool:
    return value is not None and value.dtype == ir.DataType.FLOAT


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


def _int64_constant(graph: ir.Graph, name: str, values) -> ir.Value:
    """A new int64 initializer of ``graph`` (shapes, axes)."""
    array = np.asarray(values, dtype=np.int64)
    value = ir.Value(name=name, shape=ir.Shape(list(array.shape)), type=ir.TensorType(ir.DataType.INT64),
                     const_value=ir.tensor(array))
    graph.register_initializer(value)
    return value


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


def fuse_tanh_gelu(graph: ir.Graph) -> int:
    """``0.5 * x * (1 + Tanh(sqrt(2/pi) * (x + 0.044715 * x**3)))`` -> com.microsoft
    ``FastGelu(x)``. Matches in inference graphs; a training forward saves Tanh for backward."""
    count = 0
    for tanh in [n for n in graph if _op(n, "Tanh")]:
        outer = tanh.inputs[0].producer()
        if not _op(outer, "Mul") or _sole_user(tanh.inputs[0]) is not tanh:
            continue
        k = math.sqrt(2 / math.pi)
        inner = next((v for v in outer.inputs if v is not None and not _is(v, k)), None)
        if inner is None or not any(_is(v, k) for v in outer.inputs) or _sole_user(inner) is not outer:
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
            power = next((v for v in mul.inputs if not _is(v, 0.044715)), None)
            if power is None or not any(_is(v, 0.044715) for v in mul.inputs):
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
            scale = ir.Value(name=f"rms_norm_ones_{hidden}", shape=ir.Shape([hidden]),
                             type=ir.TensorType(ir.DataType.FLOAT),
                             const_value=ir.tensor(np.ones(hidden, dtype=np.float32)))
            graph.register_initializer(scale)
            ones[hidden] = scale
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
    """``Reshape(Gemm(a, b, bias))`` feeding elementwise work or a GELU ->
    ``Reshape(MatMul(a, b)) + bias``. ORT's Gemm adds a bias by first broadcasting it over its
    whole output (about 1 ms of a 3 ms [1024, 1024] product on two cores); added after the
    Reshape, the bias is one pass (0.25 ms there), or joins what follows: a pointwise kernel
    (the residual add), or ORT's BiasGelu where the sum is not saved for backward. Where the
    Gemm's result is saved, the saved value is the sum reshaped back (a free view: ``rewrite``
    hands Reshape outputs to PyTorch as views)."""
    count = 0
    for gemm in [n for n in graph if _op(n, "Gemm")]:
        a, b, bias = (list(gemm.inputs) + [None] * 3)[:3]
        result = gemm.outputs[0]
        attributes = {name: gemm.attributes[name].value for name in gemm.attributes}
        if bias is None or not _is_float32(result) or bias.shape is None or len(bias.shape) != 1 \
                or attributes.get("transA", 0) or attributes.get("transB", 0) \
                or attributes.get("alpha", 1.0) != 1.0 or attributes.get("beta", 1.0) != 1.0 \
                or result.shape is None or not all(isinstance(d, int) for d in result.shape) \
                or len(result.uses()) != 1 or not _op(result.uses()[0].node, "Reshape"):
            continue
        reshape = result.uses()[0].node
        reshaped = reshape.outputs[0]
        shape = reshaped.shape
        if shape is None or len(shape) < 2 or shape[-1] != bias.shape[0] or not reshaped.uses() or not all(
                (use.node.domain == _MS and use.node.op_type in ("Gelu", "FastGelu"))
                or (use.node.domain in ("", "ai.onnx") and use.node.op_type in ("Add", "Mul", "Sub", "Div", "Identity"))
                for use in reshaped.uses()):
            continue
        product = ir.node("MatMul", [a, b])
        graph.insert_before(gemm, product)
        product.outputs[0].dtype, product.outputs[0].shape = result.dtype, result.shape
        reshape.replace_input_with(0, product.outputs[0])
        add = ir.node("Add", [reshaped, bias])
        graph.insert_after(reshape, add)
        # The sum takes the Reshape's place, name included: it may be a saved activation.
        _take_over(reshaped, add.outputs[0], "without_bias")
        add.replace_input_with(0, reshaped)
        if result.is_graph_output():  # saved for backward: the sum, shaped as the Gemm's result
            target = _int64_constant(graph, f"{result.name}_shape", list(result.shape))
            back = ir.node("Reshape", [add.outputs[0], target])
            graph.insert_after(add, back)
            _take_over(result, back.outputs[0], "gemm")
        graph.remove(gemm, safe=True)
        count += 1
    return count


#: Name -> fusion, in the order applied. Each returns how many chains it replaced.
FUSIONS: dict[str, Callable[[ir.Graph], int]] = {
    "erf_gelu": fuse_erf_gelu,
    "tanh_gelu": fuse_tanh_gelu,
    "rms_norm": fuse_rms_norm,
    "pow_one": drop_pow_one,
    "bias_after_reshape": bias_after_reshape,
}


def fuse(model: ir.Model) -> dict[str, int]:
    """Apply every fusion to ``model``'s main graph; return the count per fusion."""
    counts = {name: fusion(model.graph) for name, fusion in FUSIONS.items()}
    if any(counts.values()) and _MS not in model.opset_imports:
        model.opset_imports[_MS] = 1
    return counts
