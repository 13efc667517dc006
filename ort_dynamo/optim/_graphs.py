"""ONNX graphs for whole optimizer steps, built directly with ``onnx.helper``.

Every tensor is handed over as a flat 1-D view of its storage, so a graph's signature is just
the element count of each tensor. Hyper-parameters (lr, betas, eps, weight decay) are 0-d
float64 graph inputs: changing them never rebuilds a graph. Scalar math (bias corrections,
step sizes) runs in float64 like torch.optim's Python floats; elementwise math runs in float32.

In-place updates: the caller binds the same storage as input ``x`` and output ``x_out``. That
is safe because every node that reads ``x`` is an ancestor of the node that writes ``x_out``
(checked by ``_check_aliasing`` when a graph is built) and every such write is elementwise,
so no node can read an element of ``x`` after it was overwritten.
"""

from __future__ import annotations

import enum
from typing import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

__all__ = ["AdamWMode", "adam_step_model", "apex_unscale_model", "grad_stats_model", "unscale_clip_model", "OPSET"]

OPSET = 18
F32, F64, BOOL = TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.BOOL
HYPER_NAMES = ("lr", "beta1", "beta2", "eps", "weight_decay")


class AdamWMode(enum.IntEnum):
    """How weight decay enters the Adam update (values as onnxruntime-training had them)."""

    ADAM_L2_REGULARIZATION = 0  # torch.optim.Adam(weight_decay=...): decay added to the gradient
    ADAMW_TRANSFORMERS = 1  # transformers' AdamW: decay after the update, eps before bias correction
    ADAMW_TORCH = 2  # torch.optim.AdamW: decoupled decay before the update


class _Builder:
    """Tiny helper: unique names, nodes, initializers."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self._n = 0

    def op(self, op_type: str, *inputs: str, out: str | None = None, n_out: int = 1, **attrs) -> str:
        if out is None:
            self._n += 1
            outs = [f"_{op_type.lower()}{self._n}_{i}" for i in range(n_out)]
        else:
            outs = [out]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, **attrs))
        return outs[0] if n_out == 1 else outs

    def const(self, value, dtype) -> str:
        self._n += 1
        name = f"_c{self._n}"
        self.inits.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name

    def model(self, inputs, outputs, name: str) -> bytes:
        graph = helper.make_graph(self.nodes, name, inputs, outputs, self.inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
        model.ir_version = 8
        _check_aliasing(model)
        return model.SerializeToString()


def _vec(name: str, elem_type: int, n: int) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem_type, [n])


def _scalar(name: str, elem_type: int) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem_type, [])


def adam_step_model(numels: Sequence[int], param_slots: Sequence[int], stepped_slots: Sequence[int],
                    n_slots: int, elem_type: int, mode: AdamWMode, bias_correction: bool) -> bytes:
    """One Adam step over ``len(numels)`` parameters of one dtype.

    Inputs: ``p{i}, g{i}, m{i}, v{i}`` (param, grad, exp_avg, exp_avg_sq; flat), ``steps``
    (float32 [n_slots], the step count of every parameter of the group) and the 0-d float64
    hyper-parameters. Outputs ``p{i}_out, m{i}_out, v{i}_out, steps_out`` are bound to the
    same storage as the inputs. ``param_slots[i]`` is parameter i's slot in ``steps``; the
    counts of all parameters stepped now (``stepped_slots``, which may include empty ones
    that have no tensors in the graph) are incremented.
    """
    if elem_type not in (F32, TensorProto.FLOAT16, TensorProto.BFLOAT16, F64):
        raise ValueError(f"FusedAdam graphs support float32/float16/bfloat16/float64, not ONNX type {elem_type}")
    b = _Builder()
    compute = F64 if elem_type == F64 else F32  # low-precision params compute in float32
    k = len(numels)
    # steps_out = steps + 1 where a parameter is stepped now
    mask = np.zeros(n_slots, dtype=np.float32)
    mask[list(stepped_slots)] = 1.0
    b.op("Add", "steps", b.const(mask, np.float32), out="steps_out")
    lr, beta1, beta2, eps, wd = HYPER_NAMES
    one = b.const(1.0, np.float64)

    def to_compute(x: str) -> str:
        return x if compute == F64 else b.op("Cast", x, to=compute)

    # Per-parameter scalar factors, float64 vectors [k], then split into k pieces of shape [1].
    step = b.op("Cast", b.op("Gather", "steps_out", b.const(list(param_slots), np.int64)), to=F64)
    if bias_correction:
        bc1 = b.op("Sub", one, b.op("Pow", beta1, step))
        bc2 = b.op("Sub", one, b.op("Pow", beta2, step))
    else:
        bc1 = bc2 = b.op("Expand", one, b.const([k], np.int64))
    if mode == AdamWMode.ADAMW_TRANSFORMERS:
        # transformers: step_size = lr * sqrt(bc2) / bc1; denom = sqrt(v) + eps
        neg_step_size = b.op("Neg", b.op("Div", b.op("Mul", lr, b.op("Sqrt", bc2)), bc1))
        per_param = [neg_step_size]
    else:
        # torch: step_size = lr / bc1; denom = sqrt(v) / sqrt(bc2) + eps
        neg_step_size = b.op("Neg", b.op("Div", lr, bc1))
        per_param = [neg_step_size, b.op("Sqrt", bc2)]
    split = []
    for vec in per_param:
        vec = to_compute(vec)
        split.append([vec] if k == 1 else b.op("Split", vec, n_out=k, num_outputs=k))
    # Group-wide scalars in the compute type.
    c_beta1, c_beta2 = to_compute(beta1), to_compute(beta2)
    c_1m_beta1 = to_compute(b.op("Sub", one, beta1))
    c_1m_beta2 = to_compute(b.op("Sub", one, beta2))
    c_eps, c_wd = to_compute(eps), to_compute(wd)
    if mode == AdamWMode.ADAMW_TORCH:
        c_decay = to_compute(b.op("Sub", one, b.op("Mul", lr, wd)))  # param *= 1 - lr * wd
    elif mode == AdamWMode.ADAMW_TRANSFORMERS:
        c_decay = to_compute(b.op("Neg", b.op("Mul", lr, wd)))  # param += -lr * wd * param

    inputs, outputs = [_vec("steps", F32, n_slots)], [_vec("steps_out", F32, n_slots)]
    inputs += [_scalar(name, F64) for name in HYPER_NAMES]
    state_type = F64 if elem_type == F64 else F32
    for i, n in enumerate(numels):
        p, g, m, v = f"p{i}", f"g{i}", f"m{i}", f"v{i}"
        inputs += [_vec(p, elem_type, n), _vec(g, elem_type, n), _vec(m, state_type, n), _vec(v, state_type, n)]
        outputs += [_vec(p + "_out", elem_type, n), _vec(m + "_out", state_type, n),
                    _vec(v + "_out", state_type, n)]
        pf = p if elem_type == compute else b.op("Cast", p, to=compute)
        gf = g if elem_type == compute else b.op("Cast", g, to=compute)
        neg_step = split[0][i]
        if mode == AdamWMode.ADAM_L2_REGULARIZATION:
            gf = b.op("Add", gf, b.op("Mul", pf, c_wd))  # grad + wd * param
        elif mode == AdamWMode.ADAMW_TORCH:
            pf = b.op("Mul", pf, c_decay)
        if mode == AdamWMode.ADAMW_TRANSFORMERS:
            # exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
            b.op("Add", b.op("Mul", m, c_beta1), b.op("Mul", gf, c_1m_beta1), out=m + "_out")
        else:
            # exp_avg.lerp_(grad, 1 - beta1) == m + (1 - beta1) * (g - m) for weights < 0.5
            b.op("Add", m, b.op("Mul", b.op("Sub", gf, m), c_1m_beta1), out=m + "_out")
        # exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        b.op("Add", b.op("Mul", v, c_beta2), b.op("Mul", b.op("Mul", gf, c_1m_beta2), gf), out=v + "_out")
        sqrt_v = b.op("Sqrt", v + "_out")
        if mode == AdamWMode.ADAMW_TRANSFORMERS:
            denom = b.op("Add", sqrt_v, c_eps)
        else:
            denom = b.op("Add", b.op("Div", sqrt_v, split[1][i]), c_eps)
        # param.addcdiv_(exp_avg, denom, value=-step_size)
        new_p = b.op("Add", pf, b.op("Div", b.op("Mul", m + "_out", neg_step), denom))
        if mode == AdamWMode.ADAMW_TRANSFORMERS:
            new_p = b.op("Add", new_p, b.op("Mul", new_p, c_decay))
        if elem_type == compute:
            b.op("Identity", new_p, out=p + "_out")
        else:
            b.op("Cast", new_p, to=elem_type, out=p + "_out")
    return b.model(inputs, outputs, f"adam_step_{mode.name.lower()}")


def unscale_clip_model(numels: Sequence[int], elem_types: Sequence[int], clip: bool,
                       master_grads: bool) -> bytes:
    """All-finite check, unscale, global L2 norm and clip coefficient over all gradients.

    Inputs: ``g{i}`` (flat grads, scaled by the loss scale), ``inv_scale`` and ``max_norm``
    (0-d float32). Outputs: ``g{i}_out`` (grad * inv_scale * clip_coef; float32 when
    ``master_grads`` else the grad's dtype), ``norm`` (global L2 norm of the unscaled grads,
    before clipping) and ``found_inf`` (bool: the norm is not finite, i.e. some grad is inf/NaN).
    """
    b = _Builder()
    inputs = [_scalar("inv_scale", F32), _scalar("max_norm", F32)]
    outputs = [_scalar("norm", F32), _scalar("found_inf", BOOL)]
    as_f32 = []
    for i, (n, t) in enumerate(zip(numels, elem_types)):
        inputs.append(_vec(f"g{i}", t, n))
        outputs.append(_vec(f"g{i}_out", F32 if master_grads else t, n))
        as_f32.append(f"g{i}" if t == F32 else b.op("Cast", f"g{i}", to=F32))
    def global_norm(tensors: list[str], scale: str | None) -> str:
        # Sum of squares per tensor in float32 (fp16 squares would overflow), then the norm.
        squares = [b.op("ReduceSumSquare", t, keepdims=0) for t in tensors]
        total = b.op("Sqrt", squares[0] if len(squares) == 1 else b.op("Sum", *squares))
        norm = b.op("Mul", total, scale, out="norm") if scale else b.op("Identity", total, out="norm")
        # x * 0 is NaN exactly when x is inf or NaN: one test for "some element is not finite".
        b.op("IsNaN", b.op("Mul", norm, b.const(0.0, np.float32)), out="found_inf")
        return norm

    if clip:
        # The norm is read before any gradient is overwritten: every output depends on it.
        norm = global_norm(as_f32, "inv_scale")
        # torch.nn.utils.clip_grad_norm_: coef = min(max_norm / (norm + 1e-6), 1)
        coef = b.op("Div", "max_norm", b.op("Add", norm, b.const(1e-6, np.float32)))
        coef = b.op("Min", coef, b.const(1.0, np.float32))
        factor = b.op("Mul", "inv_scale", coef)
    else:
        factor = "inv_scale"
    unscaled = []
    for i, (g, t) in enumerate(zip(as_f32, elem_types)):
        scaled = b.op("Mul", g, factor)
        if master_grads or t == F32:
            unscaled.append(b.op("Identity", scaled, out=f"g{i}_out"))
        else:
            b.op("Cast", scaled, to=t, out=f"g{i}_out")
            unscaled.append(b.op("Cast", f"g{i}_out", to=F32))
    if not clip:
        # Without clipping nothing orders the norm before the in-place writes, so take the
        # norm of the unscaled outputs (what torch computes after GradScaler.unscale_).
        global_norm(unscaled, None)
    return b.model(inputs, outputs, "unscale_clip")


def grad_stats_model(numels: Sequence[int], elem_types: Sequence[int]) -> bytes:
    """Read-only sum of squares and all-finite check over gradients (no in-place outputs).

    Inputs ``g{i}`` (flat). Outputs ``sumsq`` (0-d float64: sum of all squared elements,
    accumulated in float64 like DeepSpeed's ``get_norm_dtype()``) and ``found_inf`` (bool:
    some element is inf or NaN). For float32/float16/bfloat16 grads a float64 sum of squares
    cannot overflow (float32 max squared is ~1e77), so it is non-finite exactly when some
    element is (fp16 grads are cast through float32: ORT's direct fp16->float64 Cast is slow on
    CPU, and the values are the same); float64 grads get a separate exact test (``sum(g * 0)`` is NaN iff some
    element is inf/NaN, and cannot overflow).
    """
    b = _Builder()
    inputs = [_vec(f"g{i}", t, n) for i, (n, t) in enumerate(zip(numels, elem_types))]
    outputs = [_scalar("sumsq", F64), _scalar("found_inf", BOOL)]
    squares, probes = [], []
    zero64 = b.const(0.0, np.float64)
    for i, t in enumerate(elem_types):
        if t == TensorProto.FLOAT16:
            # fp16 squares summed in float32 cannot overflow (65504**2 * 2**64 < 3.4e38) and
            # the float32 copy is half the size of a float64 one.
            f64 = b.op("Cast", b.op("Cast", f"g{i}", to=F32), to=F64)
            squares.append(b.op("ReduceSumSquare", f64, keepdims=0))
            continue
        g64 = f"g{i}" if t == F64 else b.op("Cast", f"g{i}", to=F64)
        squares.append(b.op("ReduceSumSquare", g64, keepdims=0))
        if t == F64:
            probes.append(b.op("ReduceSum", b.op("Mul", g64, zero64), keepdims=0))
    total = squares[0] if len(squares) == 1 else b.op("Sum", *squares)
    b.op("Identity", total, out="sumsq")
    probe = b.op("Mul", total, zero64)
    if probes:
        probe = b.op("Sum", probe, *probes)
    b.op("IsNaN", probe, out="found_inf")
    return b.model(inputs, outputs, "grad_stats")


def _check_aliasing(model: onnx.ModelProto) -> None:
    """Every reader of input ``x`` must be an ancestor of the writer of output ``x_out``."""
    producers = {out: node for node in model.graph.node for out in node.output}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        for name in dict.fromkeys(node.input):
            readers.setdefault(name, []).append(node)
    outputs = {o.name for o in model.graph.output}
    for inp in model.graph.input:
        out_name = inp.name + "_out"
        if out_name not in outputs:
            continue
        ancestors: set[int] = set()
        stack = [producers[out_name]]
        while stack:
            node = stack.pop()
            if id(node) in ancestors:
                continue
            ancestors.add(id(node))
            stack += [producers[i] for i in node.input if i in producers]
        bad = [n.name or n.op_type for n in readers.get(inp.name, ()) if id(n) not in ancestors]
        if bad:
            raise AssertionError(f"in-place output {out_name} could be written before {bad} read {inp.name}")


def apex_unscale_model(new_numels: Sequence[int], stash_numels: Sequence[int]) -> bytes:
    """apex amp O2's unscale of fp16 model grads into fp32 master grads, plus the overflow flag.

    Inputs: ``a{i}`` (fp16 model grads whose master grad is new), ``b{j}`` (fp16 model grads whose
    master grad ``s{j}`` (fp32) already holds an unscaled gradient) and ``inv_scale`` (0-d float32,
    ``1 / loss_scale``). Outputs: ``o{i} = float(a{i}) * inv_scale`` (apex's ``multi_tensor_scale``),
    ``s{j}_out = float(b{j}) * inv_scale + s{j}`` (its ``multi_tensor_axpby`` with b = 1, written
    in place) and ``found_inf`` (bool: some element of the *model* grads is inf/NaN, which is
    what apex's kernels and its Python fallback check; the outputs are written regardless).
    """
    b = _Builder()
    F16 = TensorProto.FLOAT16
    inputs = [_scalar("inv_scale", F32)]
    outputs = [_scalar("found_inf", BOOL)]
    sums = []
    for prefix, numels in (("a", new_numels), ("b", stash_numels)):
        for i, n in enumerate(numels):
            inputs.append(_vec(f"{prefix}{i}", F16, n))
            g = b.op("Cast", f"{prefix}{i}", to=F32)
            # |sum| <= n * 65504: a float32 sum of fp16 values is non-finite iff an element is.
            sums.append(b.op("ReduceSum", g, keepdims=0))
            scaled = b.op("Mul", g, "inv_scale")
            if prefix == "a":
                outputs.append(_vec(f"o{i}", F32, n))
                b.op("Identity", scaled, out=f"o{i}")
            else:
                inputs.append(_vec(f"s{i}", F32, n))
                outputs.append(_vec(f"s{i}_out", F32, n))
                b.op("Add", scaled, f"s{i}", out=f"s{i}_out")
    total = sums[0] if len(sums) == 1 else b.op("Sum", *sums)
    b.op("IsNaN", b.op("Mul", total, b.const(0.0, np.float32)), out="found_inf")
    return b.model(inputs, outputs, "apex_unscale")
