"""Pointwise fusion: chains of elementwise ONNX ops -> one generated C kernel each.

Stock ONNX Runtime has no gradient kernels, so a training graph's elementwise chains (SiLU and
GELU backward, softmax backward, residual adds, RoPE) run one kernel per op, each a full pass
over memory. Inductor fuses them into loops; this does the same for ORT: each group of
elementwise nodes of one iteration shape becomes one node of the ``ort_dynamo.pointwise``
domain, whose C source is generated here and compiled by ``_kernels`` into a custom-op
library the session registers.

Groups are formed in topological order: a node joins the group of one of its inputs when it
iterates over the same shape and joining creates no cycle: no path out of the group leads
back in, also through another group that an early node of the path belongs to. Every value a
group computes that something outside needs (another node, a graph output) becomes one of its
outputs, so what autograd saves for backward stays computed. Arithmetic is float32, op by op,
in ONNX's order (no reassociation, no FMA contraction); exp is ``pw_expf`` (csrc/pointwise.h,
within 1 ulp), log/tanh/erf come from the C library.

On CUDA the same groups (elementwise ops and row sums) become CUDA C (``_emit_cuda``), which
``_kernels`` compiles with NVRTC into a library for ORT's CUDA provider (csrc/pointwise_cuda*).
"""

from __future__ import annotations

import collections
import hashlib
import json
import math

import numpy as np
import onnx_ir as ir

from ._fusions import (_MS, _TANH_GELU_BETA, _TANH_GELU_KAPPA, _constant_tensor, _initializer, _int64_constant,
                       _ints, _is, _named_dims, _op, _other, _perm_keeping_last_axis, _remove_if_dead, _scalar,
                       _sole_user, _zeros_shape)
from ._fusions import softmax_written_out as _softmax_written_out
from ._fusions import _take_over as _take_over_value
from . import _op_kernels, _torch_attention
from ._op_kernels import DOMAIN

__all__ = ["DOMAIN", "cuda_table_source", "fuse_pointwise", "is_cuda", "kernel_name", "table_source"]

_MAX_RANK = 8
_MAX_ARGS = 32  # inputs or outputs per kernel; the C side has arrays of this size
#: Groups iterating over fewer elements (static shapes) stay ORT ops: a few ORT kernel launches
#: on small tensors cost microseconds, a compiled kernel costs the compiler's time.
MIN_ELEMENTS = 16384
#: ... unless the same small chain repeats this often (an unrolled RNN's cell, once per step):
#: one compiled kernel then serves every repeat, and each repeat saves several ORT launches.
MIN_REPEATS = 8

_UNARY = {
    "Neg": "(-{0})", "Abs": "fabsf({0})", "Exp": "pw_expf({0})", "Log": "logf({0})", "Sqrt": "sqrtf({0})",
    "Reciprocal": "(1.0f / {0})", "Sigmoid": "(1.0f / (1.0f + pw_expf(-{0})))", "Tanh": "tanhf({0})",
    "Erf": "erff({0})", "Relu": "({0} < 0.0f ? 0.0f : {0})", "Identity": "{0}", "Expand": "{0}",
}
_BINARY = {"Add": "+", "Sub": "-", "Mul": "*", "Div": "/"}
_ELEMENTWISE = set(_UNARY) | set(_BINARY) | {"Where", "Pow"}
#: Reductions over the last axis that a kernel computes row by row, between elementwise phases.
_ROW_REDUCTIONS = {"ReduceSum", "ReduceMean", "ReduceMax"}
#: Marks the ReduceMax of an expanded softmax (``_expand_softmax``), the only max fused.
_SOFTMAX_MAX = "ort_dynamo.softmax_max"
#: Marks a ReduceSum over every axis but the last (a bias or norm weight's gradient), with its
#: keepdims: a kernel adds each row into per-task partial sums, added up after the rows.
_COLUMN_SUM = "ort_dynamo.column_sum"
#: Marks an elementwise op on a row's reductions alone (LogSoftmax's log of the row sum): one
#: value per row, computed in the kernel of those reductions, in the phase after them.
_PER_ROW = "ort_dynamo.per_row"
#: A lane rotation along the last axis, op of ``DOMAIN`` (``_fold_rotate_half``): the
#: ``rotate_half`` of rotary embeddings, forward and backward. For the last axis of size 2h,
#: out[i] = lower * x[i + h] for i < h, upper * x[i - h] otherwise (attributes: signs, +-1).
_ROTATE = "RotateHalf"
#: Single ops worth a kernel of their own: ORT's broadcasting Where is a slow generic loop;
#: a rotation otherwise takes a Split, a Neg and a Concat. (And column sums, below.)
_ALONE_OK = {"Where", _ROTATE}

_BF16_CASTS = {(ir.DataType.FLOAT, ir.DataType.BFLOAT16), (ir.DataType.BFLOAT16, ir.DataType.FLOAT)}
_F16_CASTS = {(ir.DataType.FLOAT, ir.DataType.FLOAT16), (ir.DataType.FLOAT16, ir.DataType.FLOAT)}
#: The 16-bit float types GPU kernels hold as float32 (CPU graphs have only bfloat16 Casts left).
_HALF_TYPES = (ir.DataType.BFLOAT16, ir.DataType.FLOAT16)


def _bfloat16_cast(node: ir.Node) -> bool:
    """A Cast between float32 and bfloat16 (what CPU autocast's graphs are full of: every op
    computes in float32 between them, ``rewrite._compute_bfloat16_in_float32``). A kernel keeps
    a bfloat16 value as the float32 it is exactly, so a Cast to bfloat16 is a rounding there,
    and one back is nothing; only its inputs and outputs are 16 bits in memory."""
    if node.domain not in ("", "ai.onnx") or node.op_type != "Cast" or len(node.outputs) != 1 \
            or node.inputs[0] is None or "to" not in node.attributes:
        return False
    return (node.inputs[0].dtype, ir.DataType(node.attributes.get_int("to"))) in _BF16_CASTS


def _float16_cast(node: ir.Node) -> bool:
    """A Cast between float32 and float16 (CUDA autocast's default type): on the GPU, a kernel
    op as a bfloat16 Cast is."""
    if node.domain not in ("", "ai.onnx") or node.op_type != "Cast" or len(node.outputs) != 1 \
            or node.inputs[0] is None or "to" not in node.attributes:
        return False
    return (node.inputs[0].dtype, ir.DataType(node.attributes.get_int("to"))) in _F16_CASTS


def _rounds_to_float16(node: ir.Node) -> bool:
    return _float16_cast(node) and node.attributes.get_int("to") == ir.DataType.FLOAT16


def _rounds_to_bfloat16(node: ir.Node) -> bool:
    return _bfloat16_cast(node) and node.attributes.get_int("to") == ir.DataType.BFLOAT16


def _worth_a_kernel_alone(node: ir.Node, transposes: bool) -> bool:
    """Whether one op alone gains as a kernel. ORT's Cast to bfloat16 rounds one element at a
    time, 4-5x slower than a kernel reading in order; its Cast from bfloat16 is fast, and a
    kernel's strided reads cost more than a Transpose and a Cast. Any other op gains only
    where the kernel also does a Transpose's pass (a bias added to attention's q, k or v,
    written in the heads' layout)."""
    if _rounds_to_bfloat16(node):
        return not transposes
    return transposes and not _bfloat16_cast(node)


# -- what a node is -------------------------------------------------------------------------------

def _dims(shape) -> tuple | None:
    """Static ints and named symbols; None if any dim is unknown."""
    return None if shape is None else _named_dims(shape.dims)


def _below_kernel_size(shape) -> bool:
    """Whether an iteration shape is static and too small for a kernel of its own (MIN_ELEMENTS)."""
    return all(isinstance(d, int) for d in shape) and math.prod(shape) < MIN_ELEMENTS


def _broadcast(shapes: list[tuple]) -> tuple | None:
    rank = max(len(s) for s in shapes)
    out = []
    for axis in range(rank):
        sizes = {s[axis - rank + len(s)] for s in shapes if axis - rank + len(s) >= 0}
        sizes.discard(1)
        if len(sizes) > 1:
            return None  # unequal symbols or sizes: not provably broadcastable
        out.append(sizes.pop() if sizes else 1)
    return tuple(out)


class _Graph:
    """Shapes of the values the pass looks at, inferred for elementwise results where the
    exporter left them empty (values inside inlined torchlib functions)."""

    def __init__(self, half_ops: bool = False) -> None:
        self.shape: dict[ir.Value, tuple | None] = {}
        #: Whether ops on bfloat16 and float16 values, and Casts between float16 and float32,
        #: are kernel ops too (computed in float32 and rounded, as the GPU's are); on CPU,
        #: rewrite has already made every bfloat16 op a float32 one.
        self.half_ops = half_ops

    def dims(self, value: ir.Value) -> tuple | None:
        if value not in self.shape:
            self.shape[value] = _dims(value.shape)
        return self.shape[value]

    def elementwise_shape(self, node: ir.Node) -> tuple | None:
        """The node's output shape if it is a float32 elementwise op the kernels compute."""
        if node.domain == DOMAIN and node.op_type == _ROTATE:
            self.shape[node.outputs[0]] = self.dims(node.inputs[0])
            return self.shape[node.outputs[0]]
        if _bfloat16_cast(node) or (self.half_ops and _float16_cast(node)):
            shape = self.dims(node.inputs[0])
            known = self.dims(node.outputs[0])
            if shape is None or len(shape) > _MAX_RANK or (known is not None and known != shape):
                return None
            self.shape[node.outputs[0]] = shape
            node.outputs[0].dtype = ir.DataType(node.attributes.get_int("to"))
            return shape
        if node.domain not in ("", "ai.onnx") or node.op_type not in _ELEMENTWISE or len(node.outputs) != 1:
            return None
        out = node.outputs[0]
        if node.op_type == "Pow" and _scalar(node.inputs[1]) is None:
            return None
        if node.op_type == "Where":
            cond, *data = node.inputs
            if cond is None or cond.dtype != ir.DataType.BOOL:
                return None
        else:
            data = list(node.inputs)
        operands = data if node.op_type not in ("Pow", "Expand") else data[:1]
        dtypes = {v.dtype if v is not None else None for v in operands}
        dtype = dtypes.pop() if len(dtypes) == 1 else None
        if dtype not in ((ir.DataType.FLOAT, *_HALF_TYPES) if self.half_ops else (ir.DataType.FLOAT,)) \
                or out.dtype not in (None, dtype):
            return None
        inputs = operands + ([node.inputs[0]] if node.op_type == "Where" else [])
        shapes = [self.dims(v) for v in inputs]
        if any(s is None for s in shapes):
            return None
        if node.op_type == "Expand":
            target = self.dims(out)
            if target is None or _broadcast([shapes[0], target]) != target:
                return None
            shape = target
        else:
            shape = _broadcast(shapes)
        if shape is None or len(shape) > _MAX_RANK:
            return None
        known = self.dims(out)
        if known is not None and known != shape:
            return None
        self.shape[out] = shape
        out.dtype = dtype  # inside inlined torchlib functions, often left unset
        return shape

    def row_reduction_shape(self, node: ir.Node) -> tuple | None:
        """For a float32 sum or mean over the last axis that keeps it (a softmax or norm
        backward's row sums), the shape it iterates over: its input's."""
        if node.domain not in ("", "ai.onnx") or node.op_type not in _ROW_REDUCTIONS or len(node.inputs) != 2:
            return None
        if node.op_type == "ReduceMax" and not node.meta.get(_SOFTMAX_MAX):
            # The kernel's max passes over NaN, which only a softmax's exp() turns back into
            # NaN; a max that is a result of its own must keep torch's NaN.
            return None
        data, axes = node.inputs
        keepdims = node.attributes["keepdims"].value if "keepdims" in node.attributes else 1
        if data is None or data.dtype != ir.DataType.FLOAT or axes is None or axes.const_value is None or not keepdims:
            return None
        shape = self.dims(data)
        if not shape or shape[-1] == 1 or len(shape) > _MAX_RANK:
            return None
        if [int(a) for a in axes.const_value.numpy().reshape(-1)] not in ([-1], [len(shape) - 1]):
            return None
        out = node.outputs[0]
        if self.dims(out) not in (None, shape[:-1] + (1,)):
            return None
        self.shape[out] = shape[:-1] + (1,)
        out.dtype = ir.DataType.FLOAT
        return shape

    def column_sum_shape(self, node: ir.Node) -> tuple | None:
        """For a float32 sum over every axis but the last, the shape it iterates over (its
        input's); marks the node."""
        if node.domain not in ("", "ai.onnx") or node.op_type != "ReduceSum" or len(node.inputs) != 2:
            return None
        data, axes = node.inputs
        keepdims = node.attributes["keepdims"].value if "keepdims" in node.attributes else 1
        shape = self.dims(data) if data is not None else None
        if data is None or data.dtype != ir.DataType.FLOAT or axes is None or axes.const_value is None \
                or not shape or len(shape) < 2 or len(shape) > _MAX_RANK:
            return None
        rank = len(shape)
        if sorted(int(a) % rank for a in axes.const_value.numpy().reshape(-1)) != list(range(rank - 1)):
            return None
        result = (1,) * (rank - 1) + shape[-1:] if keepdims else shape[-1:]
        out = node.outputs[0]
        if self.dims(out) not in (None, result):
            return None
        self.shape[out] = result
        out.dtype = ir.DataType.FLOAT
        node.meta[_COLUMN_SUM] = bool(keepdims)
        return shape


def _row_reduction(node: ir.Node) -> bool:
    return node.op_type in _ROW_REDUCTIONS and node.meta.get(_COLUMN_SUM) is None


def _column_sum(node: ir.Node) -> bool:
    return node.meta.get(_COLUMN_SUM) is not None


# -- grouping -------------------------------------------------------------------------------------

class _Group:
    def __init__(self, shape: tuple, first: int) -> None:
        self.shape = shape
        self.nodes: list[ir.Node] = []
        self.first = first
        self.last = first


def _chain(group: _Group) -> tuple:
    """What makes two groups the same chain: their shape and their ops in order."""
    return group.shape, tuple(node.op_type for node in group.nodes)


def _groups(graph: ir.Graph, info: _Graph | None = None, reductions: str = "all") -> tuple[list[_Group], _Graph]:
    """Groups of nodes one kernel each computes; ``reductions``: "all" (row and column sums
    too) or "rows" (row sums, not column sums)."""
    info = info if info is not None else _Graph()
    order: dict[ir.Node, int] = {}
    group_of: dict[ir.Node, _Group] = {}
    groups: list[_Group] = []

    def predecessors(unit_nodes):
        for member in unit_nodes:
            for value in member.inputs:
                producer = value.producer() if value is not None else None
                if producer is not None and producer in order:
                    yield producer

    def unreached_before(group: _Group) -> int:
        """An index such that what lies wholly before it cannot read ``group``. Before the
        group's first node, unless a group spans that index: read at an early node, it reads
        through its later ones too, so the index moves back to that group's first node."""
        index = group.first
        while True:
            earlier = min((other.first for other in groups if other.first < index <= other.last), default=index)
            if earlier == index:
                return index
            index = earlier

    def depends_on(starts: list[ir.Node], group: _Group) -> bool:
        """Whether one of ``starts`` (outside ``group``) reads, through any path of the graph
        as fused so far, a value ``group`` computes: then ``group`` cannot also read it."""
        horizon = unreached_before(group)
        seen, stack = set(), list(starts)
        while stack:
            node = stack.pop()
            unit = group_of.get(node)
            key = id(unit) if unit is not None else id(node)
            if key in seen:
                continue
            seen.add(key)
            if unit is group:
                return True
            last = unit.last if unit is not None else order[node]
            if last < horizon:
                continue
            stack.extend(predecessors(unit.nodes if unit is not None else [node]))
        return False

    def _sibling(node: ir.Node, shape: tuple, producers: list[ir.Node]) -> _Group | None:
        """A group that reads one of ``node``'s full-size inputs too (SwiGLU's backward reads
        the product's gradient for both factors): joined, the kernel reads it once and
        ``node`` is no separate pass. Not when ``node``'s inputs come from the group, through
        any path."""
        for value in node.inputs:
            if value is None or value.const_value is not None or info.dims(value) != shape:
                continue
            for use in value.uses():
                group = group_of.get(use.node)
                if group is None or group.shape != shape or len(group.nodes) >= 64:
                    continue
                if not depends_on(producers, group):
                    return group
        return None

    for index, node in enumerate(graph):
        order[node] = index
        shape = info.elementwise_shape(node)
        if not shape:
            shape = info.row_reduction_shape(node) or (reductions == "all" and info.column_sum_shape(node)) or None
        if not shape:  # none, or a 0-d result: nothing to loop over
            continue
        producers = [v.producer() for v in node.inputs if v is not None and v.producer() in order]
        per_row = _per_row_group(node, shape, producers, group_of)
        if per_row is not None:
            node.meta[_PER_ROW] = True
            per_row.nodes.append(node)
            per_row.last = index
            group_of[node] = per_row
            continue
        # A column sum is complete only after every row: what reads it is in another kernel.
        after_sums = {id(group_of[p]) for p in producers if p in group_of and _column_sum(p)}
        candidates = [g for g in dict.fromkeys(group_of[p] for p in producers if p in group_of)
                      if g.shape == shape and id(g) not in after_sums]
        chosen = None
        for candidate in candidates:
            if len(candidate.nodes) >= 64:
                continue
            outside = [p for p in producers if group_of.get(p) is not candidate]
            if not depends_on(outside, candidate):
                chosen = candidate
                break
        for other in candidates if chosen is not None else ():
            # The node reads two groups (q * cos + rotate_half(q) * sin): one kernel, unless
            # a path outside them leads from one to the other.
            if other is chosen or len(chosen.nodes) + len(other.nodes) >= 64 or any(
                    _column_sum(p) and group_of.get(p) in (chosen, other)
                    for group in (chosen, other) for p in predecessors(group.nodes)):
                continue
            outside_other = [p for p in predecessors(other.nodes) if group_of.get(p) not in (chosen, other)]
            outside_chosen = [p for p in [*predecessors(chosen.nodes), *producers]
                              if group_of.get(p) not in (chosen, other)]
            if depends_on(outside_other, chosen) or depends_on(outside_chosen, other):
                continue
            chosen.nodes = sorted(chosen.nodes + other.nodes, key=order.__getitem__)
            chosen.first, chosen.last = min(chosen.first, other.first), max(chosen.last, other.last)
            for member in other.nodes:
                group_of[member] = chosen
            groups.remove(other)
        if chosen is None and not candidates:
            chosen = _sibling(node, shape, producers)
        if chosen is None:
            chosen = _Group(shape, index)
            groups.append(chosen)
        chosen.nodes.append(node)
        chosen.last = index
        group_of[node] = chosen
    return groups, info


def _per_row_group(node: ir.Node, shape: tuple, producers: list[ir.Node], group_of: dict) -> _Group | None:
    """The group whose row reductions (or values per row made from them) are all ``node``
    reads besides one-element constants, if ``node`` is elementwise with one value per row of
    that group: it joins that group rather than being an ORT op between two kernels."""
    if shape[-1] != 1 or node.op_type not in _ELEMENTWISE or node.op_type == "Expand" or not producers:
        return None
    groups = {id(group_of.get(p)): group_of.get(p) for p in producers}
    group = next(iter(groups.values()))
    if len(groups) != 1 or group is None or len(group.nodes) >= 64 or len(group.shape) != len(shape) \
            or group.shape[:-1] != shape[:-1] or group.shape[-1] == 1 \
            or not all(_row_reduction(p) or p.meta.get(_PER_ROW) for p in producers):
        return None
    made_here = {p.outputs[0] for p in producers}
    if any(v is not None and v not in made_here and _scalar(v) is None for v in node.inputs):
        return None
    return group


def _without_escaping_per_row_values(group: _Group, members: set) -> None:
    """A value per row that is read outside the kernel would need an output of its own: it is
    left to ORT, with what in the group reads it."""
    while True:
        escaping = {n for n in group.nodes if n.meta.get(_PER_ROW) and (
            n.outputs[0].is_graph_output() or any(u.node not in members for u in n.outputs[0].uses()))}
        if not escaping:
            return
        dropped = set(escaping)
        for n in group.nodes:  # in graph order: readers come after what they read
            if any(v is not None and v.producer() in dropped for v in n.inputs):
                dropped.add(n)
        group.nodes = [n for n in group.nodes if n not in dropped]
        members.difference_update(dropped)
        for n in dropped:
            n.meta.pop(_PER_ROW, None)


# -- code generation ------------------------------------------------------------------------------

def _literal(number: float) -> str:
    number = float(np.float32(number))
    if math.isnan(number):
        return "NAN"
    if math.isinf(number):
        return "INFINITY" if number > 0 else "(-INFINITY)"
    return f"{number.hex()}f"


def _kind(shape: tuple, out: tuple) -> str:
    """How an input of ``shape`` is read while iterating over ``out`` (static, so the inner
    loop has constant strides): full, scalar, suffix (broadcast over leading axes only, like
    a bias or RoPE's tables), col (constant along the last axis, full elsewhere, like a
    reduction's result); otherwise each row starts at a strided offset and is read along the
    last axis (strided_row: an attention mask shared by the heads) or not (strided_col)."""
    shape = (1,) * (len(out) - len(shape)) + shape
    if shape == out:
        return "full"
    if all(d == 1 for d in shape):
        return "scalar"
    if len(out) >= 1 and out[-1] != 1:
        lead = next(i for i, d in enumerate(shape) if d != 1)
        if all(d == 1 for d in shape[:lead]) and shape[lead:] == out[lead:]:
            return "suffix"
        if shape[-1] == 1 and shape[:-1] == out[:-1]:
            return "col"
        return "strided_row" if shape[-1] == out[-1] else "strided_col"
    return "general"


def _expression(node: ir.Node, ref) -> str:
    """C expression of an elementwise ``node``'s float32 result, ``ref(value)`` naming its
    operands (the same on CPU and GPU)."""
    op = node.op_type
    if op in _BINARY:
        return f"({ref(node.inputs[0])} {_BINARY[op]} {ref(node.inputs[1])})"
    if op == "Where":
        return f"({ref(node.inputs[0])} ? {ref(node.inputs[1])} : {ref(node.inputs[2])})"
    if op == "Pow":
        exponent = _scalar(node.inputs[1])
        base = ref(node.inputs[0])
        # A cube as torch and ORT compute it; libmvec's SIMD powf takes a slow path for a
        # negative base (9 ms per million floats, against 0.24 for tanhf).
        return {2.0: f"({base} * {base})", 3.0: f"({base} * {base} * {base})", 1.0: base, 0.5: f"sqrtf({base})",
                -1.0: f"(1.0f / {base})"}.get(exponent, f"powf({base}, {_literal(exponent)})")
    if op == "Cast":
        x = ref(node.inputs[0])
        return f"pw_round_bf16({x})" if _rounds_to_bfloat16(node) else f"pw_round_f16({x})" \
            if _rounds_to_float16(node) else x
    return _UNARY[op].format(ref(node.inputs[0]))


def _phases(group: _Group) -> dict[ir.Node, int]:
    """Loop over a row each node is computed in: a node reading a row sum (a reduction of
    phase p) is computed in phase p + 1, after that sum is complete."""
    phase: dict[ir.Node, int] = {}
    for node in group.nodes:
        after = [phase[v.producer()] + _row_reduction(v.producer())
                 for v in node.inputs if v is not None and v.producer() in phase]
        phase[node] = max(after, default=0)
    return phase


def _phase_plan(group: _Group, phase: dict[ir.Node, int], finals: list[ir.Node], also: tuple | list = (),
                stashed: frozenset | set = frozenset()):
    """What a kernel computes in each phase of a row (``phase``: ``_phases(group)``), on the CPU
    and the GPU alike: yields (k, the row sums phase k closes, the values per row it computes
    first (each once in the kernel), the nodes it computes at each lane). Nodes of earlier phases
    are recomputed where a later one needs them, except ``stashed`` ones, which the last phase
    reads back (``_stashes``): what only they read, it does not compute. The last phase computes
    ``finals`` (the full outputs' producers) and what they, its sums and ``also`` (column sums)
    read."""
    last = max(phase.values())
    reductions = [n for n in group.nodes if _row_reduction(n)]

    def needed(targets, leaves=frozenset()):
        """Non-reduction nodes ``targets`` read, transitively within the group (not past
        ``leaves``), in order."""
        want, stack = set(), list(targets)
        while stack:
            node = stack.pop()
            for v in node.inputs if node not in leaves else ():
                p = v.producer() if v is not None else None
                if p in phase and not _row_reduction(p) and not _column_sum(p) and p not in want:
                    want.add(p)
                    stack.append(p)
        return [n for n in group.nodes if n in want]

    done: set[ir.Node] = set()
    for k in range(last + 1):
        closing = [n for n in reductions if phase[n] == k]
        if k == last:
            wanted = set(needed([*finals, *closing, *also], stashed)) | set(finals)
            nodes = [n for n in group.nodes if n in wanted]
        else:
            nodes = needed(closing)
        per_row = [n for n in nodes if n.meta.get(_PER_ROW) and n not in done]
        done.update(per_row)
        yield k, closing, per_row, [n for n in nodes if not n.meta.get(_PER_ROW)]


#: Ops worth keeping rather than computing twice: an earlier phase's value the last phase needs
#: again (softmax's exp) is stashed in an output's row (``_stashes``).
_COSTLY = {"Exp", "Log", "Erf", "Tanh", "Sigmoid"}


def _stashes(group: _Group, phase: dict[ir.Node, int], finals: list[ir.Node], also: list[ir.Node],
             rows: list[int]) -> dict[ir.Node, tuple[int, int]]:
    """Costly values (``_COSTLY``) an earlier phase computes and the last computes again, each
    kept in the row of a full output ``rows`` (indices of outputs) until the last phase reads it
    back and writes the output over it: {node: (the phase that writes it, output index)}.
    Softmax's exp is computed once, not twice (its kernel 1.7x faster). Lane i writes and reads
    index i of the row only, so an output must share memory with no input: the kernel checks
    that at run time (``PwKernelDef.stashes``) and otherwise runs its strided version, which
    recomputes."""
    last = max(phase.values())
    if last == 0 or not rows:
        return {}
    plan = list(_phase_plan(group, phase, finals, also))
    again = set(plan[-1][3])
    writes = {}
    for k, _, _, nodes in plan[:-1]:
        for node in nodes:
            if node.op_type in _COSTLY and node in again:
                writes[node] = k  # the latest earlier phase that computes it
    return {node: (k, j) for (node, k), j in zip(writes.items(), rows)}


def _emit(group: _Group, info: _Graph, inputs: list[ir.Value], outputs: list[ir.Value], name: str,
          perms: dict[int, tuple] | None = None, out_perms: dict[int, tuple] | None = None) -> str:
    """C source of one kernel: ``<name>_fast`` with static read patterns and ``<name>_any``
    with runtime strides (used when the actual shapes do not fit the static ones). Each row is
    walked once per phase: a phase ends with the row sums the next one reads; nodes of earlier
    phases are recomputed where a later phase needs them rather than stored, except the costly
    ones ``_stashes`` keeps in an output's row (the fast version only). ``perms``: inputs
    read through a transpose (by index: iteration axis -> axis in memory); ``out_perms``:
    outputs written transposed (keeping the last axis)."""
    perms, out_perms = perms or {}, out_perms or {}
    arg = {v: f"x{i}" for i, v in enumerate(inputs)}
    local = {node.outputs[0]: (f"s{i}" if _row_reduction(node) else f"t{i}") for i, node in enumerate(group.nodes)}

    def ref(value, shifted=False):
        """The C name of ``value`` at lane i, or (shifted) at the lane a rotation reads for i.
        A row sum is the same at every lane."""
        if value in local:
            rotates = shifted and not _row_reduction(value.producer()) and not value.producer().meta.get(_PER_ROW)
            return local[value] + ("_r" if rotates else "")
        if value in arg:
            return f"{arg[value]}{'r' if shifted else 'v'}"
        return _literal(_scalar(value))

    def statement(node, shifted=False, half=0):
        """``node``'s statement at lane i; shifted: at the lane i + h (half 0) or i - h (half 1)
        that a RotateHalf reads, recomputed from its inputs there (lane moves commute with
        elementwise ops), so no row is stored in between."""
        op = node.op_type
        r = shifted
        if op == _ROTATE:
            # The result's lane i is a sign times x's shifted lane; its shifted lane, x's lane i.
            lower, upper = node.attributes["lower"].value, node.attributes["upper"].value
            here, there = (lower, upper) if half == 0 else (upper, lower)
            sign = there if shifted else here
            expr = f"({'-' if sign < 0 else ''}{ref(node.inputs[0], not shifted)})"
        elif op == "ReduceMax":  # softmax's only: a NaN is passed over, but its exp() is NaN
            acc = local[node.outputs[0]]
            return f"{acc} = {ref(node.inputs[0])} > {acc} ? {ref(node.inputs[0])} : {acc};"
        elif op in _ROW_REDUCTIONS:
            return f"{local[node.outputs[0]]} += {ref(node.inputs[0])};"
        else:
            expr = _expression(node, lambda value: ref(value, r))
        return f"const float {ref(node.outputs[0], r)} = {expr};"

    phase = _phases(group)
    reductions = [n for n in group.nodes if _row_reduction(n)]
    column_sums = [n for n in group.nodes if _column_sum(n)]
    last = max(phase.values())
    # ONNX bools are bytes of 0 or 1; read as uint8_t, not C's bool, which gcc will not
    # vectorize next to float stores.
    ctype = {v: {ir.DataType.BOOL: "uint8_t", ir.DataType.BFLOAT16: "uint16_t"}.get(v.dtype, "float") for v in inputs}
    bf16_out = [v.dtype == ir.DataType.BFLOAT16 for v in outputs]
    kinds = [_kind(info.dims(v), group.shape) for v in inputs]
    for i, perm in perms.items():  # rows at strided offsets: along the last axis only if it stays last
        shape = info.dims(inputs[i])
        if kinds[i] != "scalar":
            kinds[i] = ("strided_row" if shape[-1] == group.shape[-1] else "strided_col") \
                if perm[-1] == len(perm) - 1 else "general"
    # Per output: 0 a full tensor, 1 a row sum, 2 a column sum, 3 one that keeps its axes.
    out_kind = [1 if _row_reduction(v.producer()) else
                (3 if v.producer().meta[_COLUMN_SUM] else 2) if _column_sum(v.producer()) else 0 for v in outputs]

    finals = [v.producer() for v, kind in zip(outputs, out_kind) if kind == 0]
    rotates = any(n.op_type == _ROTATE for n in group.nodes)
    # The fast version only (no rotation: its second half would read lanes already written).
    stash = {} if rotates else _stashes(group, phase, finals, column_sums, [
        j for j, kind in enumerate(out_kind) if kind == 0 and j not in out_perms and not bf16_out[j]])

    def loops(load, stash):
        lines = []

        def computed(n, k, half=0):
            """``n``'s statement in phase ``k``: the last phase reads a stashed value back."""
            if n in stash and k == last:
                return f"const float {ref(n.outputs[0])} = o{stash[n][1]}[i];"
            return statement(n, half=half)

        for k, closing, per_row, nodes in _phase_plan(group, phase, finals, column_sums, set(stash)):
            # Values per row: once, before the lanes (their reductions are complete by now).
            lines += [statement(n) for n in per_row]
            if closing:
                lines += [f"float {local[n.outputs[0]]} = {'-INFINITY' if n.op_type == 'ReduceMax' else '0.0f'};"
                          for n in closing]
            # A rotation reads lane i + h in the row's first half, i - h in its second: one loop
            # per half keeps every read contiguous (vectorized). Unused shifted statements and
            # loads are dead code to the compiler.
            rotating = any(n.op_type == _ROTATE for n in nodes)
            halves = [(0, "0", "h", "i + h"), (1, "h", "n", "i - h")] if rotating else [(0, "0", "n", None)]
            for half, lo, hi, shift in halves if k < last or closing or nodes or column_sums else ():
                # Lane i reads and writes index i only (an output bound in place over its input,
                # as optimizer steps do, included): independent lanes. Without saying so, gcc
                # checks every input/output pair for overlap at run time, and past about ten
                # pairs gives up and runs the loop scalar.
                clauses = [f"reduction({kind}:{', '.join(names)})" for kind, names in (
                    ("max", [local[n.outputs[0]] for n in closing if n.op_type == "ReduceMax"]),
                    ("+", [local[n.outputs[0]] for n in closing if n.op_type != "ReduceMax"])) if names]
                lines.append(" ".join(["#pragma omp simd", *clauses]))
                body = load("i", "v") + (load(shift, "r") if shift else [])
                for n in nodes:
                    body += [computed(n, k, half)] + ([statement(n, True, half)] if shift else [])
                body += [f"o{stash[n][1]}[i] = {ref(n.outputs[0])};" for n in nodes if stash.get(n, (-1,))[0] == k]
                lines += [f"for (int64_t i = {lo}; i < {hi}; ++i) {{"]
                lines += ["  " + x for x in body + [statement(n) for n in closing]]
                if k == last:
                    lines += [f"  o{j}[i] = {'pw_bf16_bits(%s)' % local[v] if bf16_out[j] else local[v]};"
                              for j, v in enumerate(outputs) if out_kind[j] == 0]
                    # Into this task's partial sums: lane i of every row of the task.
                    lines += [f"  o{j}[i] += {ref(v.producer().inputs[0])};" for j, v in enumerate(outputs)
                              if out_kind[j] >= 2]
                lines += ["}"]
            for n in closing:
                s_ = local[n.outputs[0]]
                if n.op_type == "ReduceMean":
                    lines.append(f"{s_} /= (float)n;")
            lines += [f"o{j}[0] = {local[v]};" for j, v in enumerate(outputs)
                      if out_kind[j] == 1 and phase[v.producer()] == k]
        return lines

    offsets = {"full": "r * inner", "suffix": "(r * inner) % a->numel_in[{i}]", "col": "r", "scalar": "0",
               "strided_row": "pw_offset(a, {i}, r)", "strided_col": "pw_offset(a, {i}, r)",
               "general": "pw_offset(a, {i}, r)"}
    fast_setup = [f"const {ctype[v]}* restrict {arg[v]} = (const {ctype[v]}*)a->in[{i}] + {offsets[k].format(i=i)};"
                  for i, (v, k) in enumerate(zip(inputs, kinds))]
    out_offsets = {0: " + r * inner", 1: " + r", 2: "", 3: ""}
    out_ctype = ["uint16_t" if bf16 else "float" for bf16 in bf16_out]
    out_setup = [f"{out_ctype[j]}* restrict o{j} = ({out_ctype[j]}*)a->out[{j}]"
                 f"{' + pw_out_offset(a, %d, r)' % j if j in out_perms else out_offsets[kind]};"
                 for j, kind in enumerate(out_kind) if kind < 2]
    # A column sum's output, while the rows run, is this task's row of partial sums.
    task_setup = [f"float* restrict o{j} = a->partial[{j}] + (r0 / a->rows_per_task) * inner;"
                  for j, kind in enumerate(out_kind) if kind >= 2]
    reads = {"full": "{x}", "suffix": "{x}", "col": "0", "scalar": "0", "strided_row": "{x}", "strided_col": "0",
             "general": "({x}) * a->inner_stride[{i}]"}

    def load(v, suffix, element):
        """The lane's value of input ``v``: a bfloat16 one as the float32 it is."""
        if ctype[v] == "uint16_t":
            return f"const float {arg[v]}{suffix} = pw_bf16_to_float({element});"
        return f"const {ctype[v]} {arg[v]}{suffix} = {element};"

    def fast_loads(lane, suffix):
        return [load(v, suffix, f"{arg[v]}[{reads[k].format(x=lane, i=i)}]") for i, (v, k) in enumerate(zip(inputs, kinds))]

    any_setup = [f"const {ctype[v]}* restrict {arg[v]} = (const {ctype[v]}*)a->in[{i}] + pw_offset(a, {i}, r);"
                 for i, v in enumerate(inputs)]

    def any_loads(lane, suffix):
        return [load(v, suffix, f"{arg[v]}[({lane}) * a->inner_stride[{i}]]") for i, v in enumerate(inputs)]

    # Rows of PW_BLOCK elements when every read is full or scalar; a row sum or a rotation
    # needs real rows.
    flat = all(k in ("full", "scalar") for k in kinds) and not (reductions or rotates or column_sums or out_perms)
    # Otherwise, where each lane stands alone, short trailing axes may run as one row.
    merges = not (flat or reductions or rotates or column_sums or perms or out_perms or stash)

    def function(suffix, setup, loads, stash):
        # The strided version only runs when run-time shapes defeat the static read pattern:
        # compiled for size, it halves the compiler's time.
        attributes = "PW_RARELY " if suffix == "any" else ""
        lines = [f"{attributes}static void {name}_{suffix}(const PwArgs* a, int64_t r0, int64_t r1) {{",
                 "  const int64_t inner = a->inner;"] + ["  " + x for x in task_setup] + [
                 "  for (int64_t r = r0; r < r1; ++r) {",
                 "    const int64_t n = pw_row_length(a, r);"] + (["    const int64_t h = n >> 1;"] if rotates else [])
        lines += ["    " + x for x in setup + out_setup + loops(loads, stash)]
        lines += ["  }", "}"]
        return "\n".join(lines)

    kind_codes = ", ".join(f"PW_{k.upper()}" for k in kinds) or "0"
    types = ", ".join({"uint8_t": "PW_BOOL", "uint16_t": "PW_BF16"}.get(ctype[v], "PW_FLOAT") for v in inputs)
    out_kinds = ", ".join(str(kind) for kind in out_kind)
    rank = len(group.shape)
    perm_table = [perms.get(i, tuple(range(rank))) for i in range(len(inputs))] + \
        [out_perms.get(j, tuple(range(rank))) for j in range(len(outputs))]
    return "\n".join([
        '#include "pointwise.h"',
        function("fast", fast_setup, fast_loads, stash),
        function("any", any_setup, any_loads, {}),
        f"static const int {name}_kinds[] = {{{kind_codes}}};",
        f"static const int {name}_types[] = {{{types}}};",
        f"static const int {name}_out_kinds[] = {{{out_kinds}}};",
        *([f"static const int {name}_perms[] = {{{', '.join(str(d) for p in perm_table for d in p)}}};"]
          if perms or out_perms else []),
        *([f"static const int {name}_out_types[] = {{{', '.join('PW_BF16' if b else 'PW_FLOAT' for b in bf16_out)}}};"]
          if any(bf16_out) else []),
        f"PW_KERNEL({name}, {len(inputs)}, {name}_types, {name}_kinds, {len(outputs)}, {name}_out_kinds, "
        f"{len(group.shape)}, {1 if flat else 0}, {name}_fast, {name}_any, 0, "
        f"{f'{name}_perms' if perms or out_perms else '0'}, {f'{name}_out_types' if any(bf16_out) else '0'}, "
        f"{1 if stash else 0}, {1 if merges else 0});",
    ]) + "\n"


def kernel_name(kernel: str) -> str:
    """The name of a kernel ``fuse_pointwise`` emitted (its op type in the model)."""
    return kernel.rsplit("PW_KERNEL(", 1)[1].split(",", 1)[0]


def table_source(kernels: list[str]) -> str:
    """The translation unit that registers ``kernels`` with ONNX Runtime: a library is this,
    the kernels' own units and ``csrc/pointwise_runtime.c``."""
    names = [kernel_name(k) for k in kernels]
    return "\n".join(['#include "pointwise.h"', *[f"PW_HIDDEN extern const PwKernelDef {n}_def;" for n in names],
                      f"static const PwKernelDef* const kernels[] = {{{''.join(f'&{n}_def, ' for n in names)}0}};",
                      "PW_DEFINE_REGISTRATION(kernels)"]) + "\n"


# -- the pass -------------------------------------------------------------------------------------

def _take_over(old: ir.Value, new: ir.Value, suffix: str, output_positions: dict | None = None) -> None:
    """``new`` replaces ``old`` everywhere (``_fusions._take_over``), as float32: values inside
    inlined torchlib functions often have no type set."""
    _take_over_value(old, new, suffix, output_positions)
    new.dtype = old.dtype if old.dtype in _HALF_TYPES else ir.DataType.FLOAT


def _drop_if_unread(graph: ir.Graph, value: ir.Value) -> None:
    """Remove what makes ``value`` (its node, or the initializer it is) once nothing reads it."""
    if value.uses() or value.is_graph_output():
        return
    producer = value.producer()
    if producer is not None:
        _remove_if_dead(graph, [producer])
    elif value.name in graph.initializers and graph.initializers[value.name] is value:
        del graph.initializers[value.name]


def _replace_node(graph: ir.Graph, node: ir.Node, steps: list[ir.Node], suffix: str) -> None:
    """``steps``, inserted before ``node``, take its place: the last one's output takes over
    ``node``'s."""
    for step in steps:
        graph.insert_before(node, step)
    _take_over(node.outputs[0], steps[-1].outputs[0], suffix)
    graph.remove(node, safe=True)


def _lanes(value: ir.Value, info: _Graph, visited: list[ir.Node]) -> tuple[ir.Value, list[tuple]] | None:
    """Where each lane (index along the last axis) of ``value`` comes from, when ``value`` only
    moves lanes of one tensor ``x`` along its last axis (Slice, zero Pad, Concat, Neg, Add of
    disjoint parts): ``(x, [(lo, hi, delta, sign), ...])``, lanes lo..hi-1 being
    ``sign * x[lane + delta]`` and any other lane 0. Appends the nodes it read to ``visited``."""
    node = value.producer()
    shape = info.dims(value)
    if node is None or node.domain not in ("", "ai.onnx") or not shape or not isinstance(shape[-1], int) \
            or value.dtype != ir.DataType.FLOAT or len(visited) > 16:
        return None
    rank, op = len(shape), node.op_type
    inputs = list(node.inputs) + [None] * 5
    if op == "Neg":
        inner = _lanes(node.inputs[0], info, visited)
        found = inner and (inner[0], [(lo, hi, d, -sign) for lo, hi, d, sign in inner[1]])
    elif op == "Slice":
        x, starts, ends, axes, steps = inputs[:5]
        source = info.dims(x)
        axes = _ints(axes) if axes is not None else [0]
        if not source or len(source) != rank or source[:-1] != shape[:-1] or not isinstance(source[-1], int) \
                or axes not in ([-1], [rank - 1]) or (steps is not None and _ints(steps) != [1]) \
                or _ints(starts) is None or len(_ints(starts)) != 1:
            return None
        start = _ints(starts)[0]
        start = min(max(start + source[-1] if start < 0 else start, 0), source[-1])
        if start + shape[-1] > source[-1]:
            return None
        found = (x, [(0, shape[-1], start, 1)])
    elif op == "Pad":
        x, pads, fill, axes = inputs[:4]
        mode = node.attributes["mode"].value if "mode" in node.attributes else "constant"
        pads = _ints(pads)
        if mode != "constant" or axes is not None or pads is None or len(pads) != 2 * rank \
                or (fill is not None and _scalar(fill) != 0.0) \
                or any(p for i, p in enumerate(pads) if i % rank != rank - 1) or min(pads) < 0:
            return None
        begin = pads[rank - 1]
        inner = _lanes(x, info, visited)
        found = inner and (inner[0], [(lo + begin, hi + begin, d - begin, sign) for lo, hi, d, sign in inner[1]])
    elif op in ("Concat", "Add"):
        axis = node.attributes["axis"].value if "axis" in node.attributes else None
        if op == "Concat" and axis not in (-1, rank - 1):
            return None
        parts, offset = [], 0
        for part in node.inputs:
            got = _lanes(part, info, visited) if part is not None else None
            width = (info.dims(part) or (None,))[-1] if part is not None else None
            if got is None or (parts and got[0] is not parts[0][0]) or not isinstance(width, int) \
                    or (op == "Add" and info.dims(part) != shape):  # no broadcasting between parts
                return None
            parts.append((got[0], [(lo + offset, hi + offset, d - offset, sign) for lo, hi, d, sign in got[1]]))
            if op == "Concat":
                offset += width
        pieces = sorted(piece for _, part in parts for piece in part)
        if any(a[1] > b[0] for a, b in zip(pieces, pieces[1:])):
            return None  # overlapping parts of an Add: not a move of lanes
        found = (parts[0][0], pieces)
    else:
        return None
    if found:
        visited.append(node)
    return found or None


def _fold_rotate_half(graph: ir.Graph, info: _Graph) -> int:
    """Lane moves that rotate the last axis by half its size (rotary embeddings'
    ``rotate_half``: ``cat(-x[..., h:], x[..., :h])``, and its backward, two Pads of slices
    added) -> one ``RotateHalf`` node, which a kernel reads at shifted lanes. Returns the
    number folded."""
    folded = 0
    for node in list(graph):
        if node.domain not in ("", "ai.onnx") or node.op_type not in ("Concat", "Add") or node.graph is None:
            continue
        value = node.outputs[0]
        shape = info.dims(value)
        if not shape or not isinstance(shape[-1], int) or shape[-1] % 2 or shape[-1] < 2:
            continue
        visited: list[ir.Node] = []
        found = _lanes(value, info, visited)
        if found is None or info.dims(found[0]) != shape:
            continue
        x, pieces = found
        half = shape[-1] // 2
        merged: list[list] = []
        for lo, hi, delta, sign in pieces:
            if merged and merged[-1][1] == lo and merged[-1][2:] == [delta, sign]:
                merged[-1][1] = hi
            else:
                merged.append([lo, hi, delta, sign])
        if [m[:3] for m in merged] != [[0, half, half], [half, 2 * half, -half]]:
            continue
        rotate = ir.node(_ROTATE, [x], domain=DOMAIN,
                         attributes={"lower": merged[0][3], "upper": merged[1][3]})
        graph.insert_before(node, rotate)
        _take_over(value, rotate.outputs[0], "unrotated")
        info.shape[rotate.outputs[0]] = shape
        _remove_if_dead(graph, reversed(visited))  # the lane moves nothing else reads
        folded += 1
    return folded


def _unfold_rotate_half(graph: ir.Graph) -> None:
    """A ``RotateHalf`` no kernel took -> Split, Neg and Concat, which ORT runs."""
    for node in list(graph):
        if node.domain != DOMAIN or node.op_type != _ROTATE:
            continue
        x = node.inputs[0]
        half = x.shape[-1] // 2
        sizes = _int64_constant(graph, f"{node.outputs[0].name}_halves", [half, half])
        split = ir.node("Split", [x, sizes], attributes={"axis": -1}, num_outputs=2)
        steps = [split]
        parts = []
        for part, sign in ((split.outputs[1], node.attributes["lower"].value), (split.outputs[0], node.attributes["upper"].value)):
            if sign < 0:
                steps.append(ir.node("Neg", [part]))
                part = steps[-1].outputs[0]
            parts.append(part)
        steps.append(ir.node("Concat", parts, attributes={"axis": -1}))
        _replace_node(graph, node, steps, "rotate_half")


#: The embedding gradient's kernel (csrc/pointwise_runtime.c), the same for every use.
_SCATTER_ADD_ROWS = "\n".join([
    '#include "pointwise.h"',
    "static const int ScatterAddRows_types[] = {PW_FLOAT, PW_INT64, PW_FLOAT};",
    "static const int ScatterAddRows_none[] = {0};",
    "PW_KERNEL(ScatterAddRows, 3, ScatterAddRows_types, ScatterAddRows_none, 1, ScatterAddRows_none, 0, 0, 0, 0, "
    "pw_scatter_add_rows);",
]) + "\n"
#: The same into zeros: its first input is the zeros' shape (int64), not the zeros.
_SCATTER_ADD_ROWS_TO_ZEROS = "\n".join([
    '#include "pointwise.h"',
    "static const int ScatterAddRowsToZeros_types[] = {PW_INT64, PW_INT64, PW_FLOAT};",
    "static const int ScatterAddRowsToZeros_none[] = {0};",
    "PW_KERNEL(ScatterAddRowsToZeros, 3, ScatterAddRowsToZeros_types, ScatterAddRowsToZeros_none, 1, "
    "ScatterAddRowsToZeros_none, 0, 0, 0, 0, pw_scatter_add_rows);",
]) + "\n"


def _constant_zeros(value: ir.Value) -> list[ir.Node] | None:
    """The nodes that make ``value`` if it is all zeros of a constant shape (a
    ``ConstantOfShape`` of 0, or a zero expanded, through Reshape and Cast), else None. ORT
    would fold them into an initializer kept for the session's life."""
    chain = []
    while True:
        tensor = _constant_tensor(value)
        if tensor is not None:  # folded already (small zeros are, by the exporter)
            return chain if not tensor.numpy().any() else None
        node = value.producer()
        if node is None or node.domain not in ("", "ai.onnx") or len(node.outputs) != 1:
            return None
        chain.append(node)
        if node.op_type in ("Reshape", "Cast", "Identity") and node.inputs:
            value = node.inputs[0]
        else:
            shape = _zeros_shape(node)
            return chain if shape is not None and _constant_tensor(shape) is not None else None


def _index_per_row(graph: ir.Graph, indices: ir.Value | None, name: str) -> ir.Value | None:
    """The [N, 1, ...] index that ``indices`` repeats along every row: ``Expand``'s input, or,
    for a constant (positions recomputed in backward: ``arange``'s chain folded whole), a new
    initializer of its first column."""
    expand = indices.producer() if indices is not None else None
    if expand is not None and expand.op_type == "Expand" and expand.domain in ("", "ai.onnx"):
        return expand.inputs[0]
    tensor = _constant_tensor(indices)
    if tensor is None or tensor.dtype != ir.DataType.INT64 or len(tensor.shape) < 2:
        return None
    rows = tensor.numpy().reshape(tensor.shape[0], -1)
    if rows.shape[1] == 0 or (rows != rows[:, :1]).any():
        return None
    return _int64_constant(graph, f"{name}_row_index", rows[:, :1].reshape((rows.shape[0],) + (1,) * (len(tensor.shape) - 1)))


def _scatter_add_rows(graph: ir.Graph, info: _Graph) -> list[bool]:
    """``ScatterElements(data, Expand(index[N, 1]), updates, axis=0, reduction=add)`` (or a
    constant index repeating one value per row), the embedding gradient as ``decompositions``
    writes it (whole rows of ``updates`` added to rows
    of ``data``) -> ``ScatterAddRows(data, index, updates)``, or ``ScatterAddRowsToZeros(shape,
    index, updates)`` where ``data`` is constant zeros (an embedding's gradient starts from them).
    ORT's ScatterElements takes an index per element through a generic loop: 1.9 ms for a
    1024x256 gradient. Returns, per node replaced, whether it went into zeros."""
    replaced = []
    for node in list(graph):
        if node.domain not in ("", "ai.onnx") or node.op_type != "ScatterElements" or len(node.inputs) != 3:
            continue
        data, indices, updates = node.inputs
        attributes = node.attributes
        reduction = attributes["reduction"].value if "reduction" in attributes else "none"
        axis = attributes["axis"].value if "axis" in attributes else 0
        shape, update_shape = info.dims(data), info.dims(updates)
        if reduction != "add" or not shape or axis not in (0, -len(shape)) \
                or data.dtype != ir.DataType.FLOAT or updates.dtype != ir.DataType.FLOAT:
            continue
        index = _index_per_row(graph, indices, node.outputs[0].name)
        if index is None:
            continue
        index_shape, expanded = info.dims(index), info.dims(indices)
        if index.dtype != ir.DataType.INT64 or not index_shape or not update_shape \
                or len(index_shape) != len(shape) or any(d != 1 for d in index_shape[1:]) \
                or expanded != update_shape or len(update_shape) != len(shape) or update_shape[1:] != shape[1:] \
                or index_shape[0] != update_shape[0]:
            _drop_if_unread(graph, index)  # a column made from a constant index, unused after all
            continue  # not one index per whole row
        zeros = _constant_zeros(data)
        if zeros is not None and all(isinstance(d, int) for d in shape):
            dims = _int64_constant(graph, f"{node.outputs[0].name}_zeros_shape", shape)
            _replace_node(graph, node, [ir.node("ScatterAddRowsToZeros", [dims, index, updates], domain=DOMAIN)],
                          "elements")
            _remove_if_dead(graph, zeros)  # now read by nothing
        else:
            _replace_node(graph, node, [ir.node("ScatterAddRows", [data, index, updates], domain=DOMAIN)], "elements")
        _drop_if_unread(graph, indices)  # the Expand, or a constant replaced by its first column
        replaced.append(zeros is not None)
    return replaced


def _elementwise_before_reshapes(graph: ir.Graph, info: _Graph) -> int:
    """``E(Reshape(a), b)`` -> ``Reshape(E(a, Reshape(b)))`` for a binary elementwise ``E``
    whose Reshape only regroups the leading axes of ``a``, an elementwise result itself. The
    loss's gradient is one: ``[tokens, vocab]``, viewed as ``[batch, seq, vocab]`` and added to
    the logits' own gradient. Moved, ``E`` joins the kernel that computes ``a``, which then
    never writes ``a`` out (4 MB at BERT's sizes, at the step's peak of memory). ``b``: of
    ``E``'s full shape (reshaped alike: free in ORT) or of one element. Returns the number moved."""
    moved = 0
    for node in list(graph):
        if node.domain not in ("", "ai.onnx") or node.op_type not in _BINARY or node.outputs[0].is_graph_output():
            continue
        shape = info.elementwise_shape(node)
        if not shape or not all(isinstance(d, int) for d in shape):
            continue
        viewed = [i for i, v in enumerate(node.inputs) if _leading_axes_view(v, shape, info)]
        if not viewed:
            continue
        a = node.inputs[viewed[0]].producer().inputs[0]
        a_shape = info.dims(a)
        if any(i not in viewed and info.dims(v) != shape and not _one_element(v, len(a_shape))
               for i, v in enumerate(node.inputs)):
            continue  # an operand broadcast along some axes: its reshape is no view
        name = node.outputs[0].name
        target = _int64_constant(graph, f"{name}_regrouped_shape", a_shape)
        steps, operands = [], []
        for i, value in enumerate(node.inputs):
            if i in viewed:
                operands.append(value.producer().inputs[0])
            elif info.dims(value) == shape:
                steps.append(ir.node("Reshape", [value, target]))
                steps[-1].outputs[0].shape, steps[-1].outputs[0].dtype = ir.Shape(list(a_shape)), value.dtype
                operands.append(steps[-1].outputs[0])
            else:
                operands.append(value)
        steps.append(ir.node(node.op_type, operands))
        steps[-1].outputs[0].shape, steps[-1].outputs[0].dtype = ir.Shape(list(a_shape)), ir.DataType.FLOAT
        back = _int64_constant(graph, f"{name}_shape", shape)
        steps.append(ir.node("Reshape", [steps[-1].outputs[0], back]))
        views = [node.inputs[i].producer() for i in viewed]
        _replace_node(graph, node, steps, "before_reshape")
        steps[-1].outputs[0].shape = ir.Shape(list(shape))  # where the old output had none
        _remove_if_dead(graph, views)
        moved += 1
    return moved


def _one_element(value: ir.Value, rank: int) -> bool:
    """A one-element operand of at most ``rank`` axes (it broadcasts to any shape of that rank)."""
    dims = _dims(value.shape) if value.shape is not None else None
    if dims is None:
        tensor = _constant_tensor(value)
        dims = tuple(tensor.shape) if tensor is not None else None
    return dims is not None and len(dims) <= rank and all(d == 1 for d in dims)


def _regroups_leading_axes(before: tuple | None, after: tuple | None) -> bool:
    """Whether a view from static ``before`` to static ``after`` only regroups the leading axes."""
    return bool(before) and bool(after) and before != after and before[-1] == after[-1] \
        and all(isinstance(d, int) for d in before + after) and math.prod(before) == math.prod(after)


def _leading_axes_view(value: ir.Value | None, shape: tuple, info: _Graph) -> bool:
    """Whether ``value`` is ``Reshape(a)`` of the full ``shape``, ``a`` an elementwise result of
    the same last axis and of other leading axes (static sizes)."""
    view = value.producer() if value is not None else None
    if view is None or view.op_type != "Reshape" or view.domain not in ("", "ai.onnx") or info.dims(value) != shape:
        return False
    a = view.inputs[0]
    made_by = a.producer() if a is not None else None
    a_shape = info.dims(a)
    if a_shape is None and made_by is not None:  # inside inlined torchlib functions: inferred
        a_shape = info.elementwise_shape(made_by)
    return _regroups_leading_axes(a_shape, shape) and a.dtype == ir.DataType.FLOAT and made_by is not None \
        and made_by.domain in ("", "ai.onnx") and made_by.op_type in _ELEMENTWISE


def _widen_before_views(graph: ir.Graph) -> int:
    """``Cast(Reshape(v) or Transpose(v), to=float)`` of a bfloat16 ``v`` -> the view of
    ``Cast(v)``, one Cast per ``v``. Under CPU autocast every GEMM reads its bfloat16 operands
    through such a Cast, after the view that shapes them: moved up, the Cast joins the kernel
    that rounds ``v`` (which then writes the float32 a GEMM reads, and ``v`` only where
    something else reads it), and a Transpose meets its MatMul, which ORT folds into a
    FusedMatMul. Returns the number of Casts moved."""
    widened: dict[ir.Value, ir.Value] = {}
    moved = 0
    for node in list(graph):
        if not _bfloat16_cast(node) or _rounds_to_bfloat16(node):
            continue
        chain, value = [], node.inputs[0]
        while (_op(value.producer(), "Reshape") or _op(value.producer(), "Transpose")) \
                and value.producer().inputs[0] is not None and value.producer().inputs[0].dtype == ir.DataType.BFLOAT16:
            chain.append(value.producer())
            value = value.producer().inputs[0]
        if not chain:
            continue
        if value not in widened:
            cast = ir.node("Cast", [value], attributes={"to": ir.DataType.FLOAT})
            cast.outputs[0].dtype, cast.outputs[0].shape = ir.DataType.FLOAT, value.shape
            graph.insert_before(node, cast)
            widened[value] = cast.outputs[0]
        x = widened[value]
        for view in reversed(chain):
            step = ir.node(view.op_type, [x, *view.inputs[1:]], attributes=dict(view.attributes))
            step.outputs[0].dtype, step.outputs[0].shape = ir.DataType.FLOAT, view.outputs[0].shape
            graph.insert_before(node, step)
            x = step.outputs[0]
        _take_over(node.outputs[0], x, "narrow_view")
        graph.remove(node, safe=True)
        _remove_if_dead(graph, chain)
        moved += 1
    return moved


def _bias_into_rounding(graph: ir.Graph) -> int:
    """``Cast(Gemm(a, b, bias), to=bfloat16)`` -> ``Cast(MatMul(a, b) + bias)``: under CPU
    autocast a Linear's product is rounded right after its Gemm, and the bias added in the
    kernel that rounds costs nothing, where ORT's Gemm first broadcasts it over its whole
    output (7.9 ms against 5.5 ms for BERT's [1024, 256] x [256, 1024]). Float32 graphs
    get the same from ``_fusions.bias_after_reshape``. Returns the number rewritten."""
    count = 0
    for gemm in [n for n in graph if _op(n, "Gemm")]:
        a, b, bias = (list(gemm.inputs) + [None] * 3)[:3]
        result = gemm.outputs[0]
        attributes = {name: gemm.attributes[name].value for name in gemm.attributes}
        if bias is None or bias.dtype != ir.DataType.FLOAT or _dims(bias.shape) is None or len(bias.shape) != 1 \
                or any(attributes.get(name, default) != default
                       for name, default in (("transA", 0), ("transB", 0), ("alpha", 1.0), ("beta", 1.0))) \
                or result.is_graph_output() or len(result.uses()) != 1 \
                or not _rounds_to_bfloat16(result.uses()[0].node):
            continue
        product = ir.node("MatMul", [a, b])
        added = ir.node("Add", [product.outputs[0], bias])
        for step in (product, added):
            step.outputs[0].dtype, step.outputs[0].shape = ir.DataType.FLOAT, result.shape
            graph.insert_before(gemm, step)
        _take_over(result, added.outputs[0], "gemm")
        graph.remove(gemm, safe=True)
        count += 1
    return count


def _consecutive_reshapes(graph: ir.Graph, info: _Graph) -> int:
    """``Reshape(Reshape(x, s1), s2)`` -> ``Reshape(x, s2)``, or ``x`` itself where that has
    the shape ``s2`` asks for (static shapes only). Returns the number removed."""
    removed = 0
    for node in list(graph):
        if node.domain not in ("", "ai.onnx") or node.op_type != "Reshape" or node.graph is None:
            continue
        inner = node.inputs[0].producer() if node.inputs[0] is not None else None
        target = info.dims(node.outputs[0])
        if inner is None or inner.op_type != "Reshape" or inner.domain not in ("", "ai.onnx") \
                or not target or not all(isinstance(d, int) for d in target):
            continue
        x = inner.inputs[0]
        if info.dims(x) == target and not node.outputs[0].is_graph_output():
            node.outputs[0].replace_all_uses_with(x)  # x keeps its name: it may be a graph input
            graph.remove(node, safe=True)
        else:
            node.replace_input_with(0, x)
        _remove_if_dead(graph, [inner])
        removed += 1
    return removed


def _chains_in_their_source_shape(graph: ir.Graph, info: _Graph) -> int:
    """``Reshape(E_k(... E_1(Reshape(m, B)) ...), A)``, both Reshapes regrouping only the leading
    axes (m of static shape A), each E_i unary or binary elementwise and read only by the next,
    its other operand of the full shape B, one value per row of B, or one element -> the chain
    computed in m's shape A, those operands viewed as A's rows (free in ORT). Attention's softmax
    backward with the probabilities recomputed is one: the scores come from a batched product
    [B * H, S, S], are viewed as [B, H, S, S] to subtract the saved log-sum-exp and go back to
    [B * H, S, S] for the next products; the two views split its kernel in three. Returns the
    number of chains moved."""
    moved = 0
    regrouped: dict[tuple, ir.Value] = {}  # (operand, shape) -> its view: one for every chain
    for view in [n for n in graph if _op(n, "Reshape")]:
        if view.graph is None or view.outputs[0].is_graph_output():
            continue
        m, value = view.inputs[0], view.outputs[0]
        a_shape, b_shape = info.dims(m), info.dims(value)
        if not _regroups_leading_axes(a_shape, b_shape):
            continue
        rows = b_shape[:-1] + (1,)
        chain, back = [], None
        while back is None:
            user = _sole_user(value)
            if user is None:
                break
            if _op(user, "Reshape") and user.inputs[0] is value and info.dims(user.outputs[0]) == a_shape:
                back = user
            elif user.domain in ("", "ai.onnx") and user.op_type in set(_UNARY) | set(_BINARY) - {"Expand"} \
                    and info.elementwise_shape(user) == b_shape \
                    and all(x is value or info.dims(x) == rows or _one_element(x, len(a_shape))
                            or (info.dims(x) == b_shape and not _fused_away(x)) for x in user.inputs):
                chain.append(user)
                value = user.outputs[0]
            else:
                break
        if back is None or not chain:
            continue
        inside = {view.outputs[0]} | {n.outputs[0] for n in chain}
        for node in chain:
            for index, x in enumerate(node.inputs):
                if x is view.outputs[0]:
                    node.replace_input_with(index, m)
                elif x not in inside and info.dims(x) in (b_shape, rows):
                    target = a_shape if info.dims(x) == b_shape else a_shape[:-1] + (1,)
                    if (x, target) not in regrouped:
                        shape = _int64_constant(graph, f"{x.name}_regrouped_{len(regrouped)}", target)
                        step = ir.node("Reshape", [x, shape])
                        step.outputs[0].shape, step.outputs[0].dtype = ir.Shape(list(target)), x.dtype
                        if x.producer() is not None:  # before every chain that reads it
                            graph.insert_after(x.producer(), step)
                        else:
                            graph.insert_before(next(iter(graph)), step)
                        regrouped[(x, target)] = step.outputs[0]
                    node.replace_input_with(index, regrouped[(x, target)])
            node.outputs[0].shape = ir.Shape(list(a_shape))
            info.shape[node.outputs[0]] = a_shape
        _take_over_value(back.outputs[0], chain[-1].outputs[0], "regrouped")
        graph.remove(back, safe=True)
        _remove_if_dead(graph, [view])
        moved += 1
    return moved


def _fused_away(value: ir.Value) -> bool:
    """A value an elementwise op makes for one reader alone: computed in the reader's kernel,
    never written out, unless the reader moves to another shape (SwiGLU's ``silu(gate) * up``,
    moved to up's source shape, left silu's kernel writing silu for a kernel of its own)."""
    made_by = value.producer()
    return made_by is not None and made_by.domain in ("", "ai.onnx") and made_by.op_type in _ELEMENTWISE \
        and _sole_user(value) is not None


def _column_sums_through_reshapes(graph: ir.Graph, info: _Graph) -> int:
    """``ReduceSum(Reshape(x), axes=all but the last)`` where the Reshape keeps ``x``'s last
    axis (a Linear's bias gradient: the rows of ``x`` flattened to ``[N, D]``, or regrouped by
    ``_elementwise_before_reshapes``) -> the same sum over ``x``'s leading axes, so that it
    joins the kernel computing ``x``. Returns the number rewritten."""
    done = 0
    for node in list(graph):
        if node.domain not in ("", "ai.onnx") or node.op_type != "ReduceSum" or len(node.inputs) != 2:
            continue
        flat, axes = node.inputs
        reshape = flat.producer() if flat is not None else None
        if reshape is None or reshape.op_type != "Reshape" or reshape.domain not in ("", "ai.onnx") \
                or axes is None or axes.const_value is None:
            continue
        x = reshape.inputs[0]
        shape, flat_shape, out_shape = info.dims(x), info.dims(flat), info.dims(node.outputs[0])
        keepdims = node.attributes["keepdims"].value if "keepdims" in node.attributes else 1
        rank = len(flat_shape) if flat_shape else 0
        if not shape or len(shape) < 2 or rank < 2 or flat_shape[-1] != shape[-1] or x.dtype != ir.DataType.FLOAT \
                or sorted(int(a) % rank for a in axes.const_value.numpy().reshape(-1)) != list(range(rank - 1)) \
                or out_shape is None:
            continue
        leading = _int64_constant(graph, f"{node.outputs[0].name}_leading_axes", range(len(shape) - 1))
        steps = [ir.node("ReduceSum", [x, leading], attributes={"keepdims": keepdims})]
        steps[0].outputs[0].dtype = ir.DataType.FLOAT
        if keepdims:  # [1, ..., 1, D] -> as many leading 1s as the graph expects
            target = _int64_constant(graph, f"{node.outputs[0].name}_shape", [1] * (rank - 1) + [-1])
            steps.append(ir.node("Reshape", [steps[0].outputs[0], target]))
        _replace_node(graph, node, steps, "flat")
        done += 1
    return done


def _expand_softmax(graph: ir.Graph, info: _Graph) -> None:
    """Softmax and LogSoftmax -> their steps (max, exp, sum). Over the last axis they fuse with
    the ops around them (attention's scale and mask) into one kernel of three passes over each
    row; ORT's own Softmax kernel is slow on short rows. Over another axis (a segmentation
    loss's channels), ORT transposes that axis last and back and runs rows as short as the
    channels (3 to 5 times eager's time): there the max and the sum stay ORT's reductions over
    that axis, and the elementwise steps become kernels. That needs that axis's length static
    (the classes' count); the other sizes may be symbolic. (Such softmaxes of at least
    ``_op_kernels._MIN_AXIS_SOFTMAX`` elements are ``TorchAxisSoftmax`` kernels by then.)"""
    axes_of: dict[int, ir.Value] = {}
    for node in list(graph):
        if node.domain not in ("", "ai.onnx") or node.op_type not in ("Softmax", "LogSoftmax"):
            continue
        x = node.inputs[0]
        shape = info.dims(x)
        axis = node.attributes["axis"].value if "axis" in node.attributes else -1
        static = bool(shape) and all(isinstance(d, int) for d in shape)
        if x.dtype != ir.DataType.FLOAT or not shape or shape[-1] == 1 or len(shape) > _MAX_RANK \
                or not -len(shape) <= axis < len(shape) or _below_kernel_size(shape):
            continue
        axis %= len(shape)
        along_rows = axis == len(shape) - 1
        if not along_rows and not (isinstance(shape[axis], int) and shape[axis] > 1):
            continue
        key = -1 if along_rows else axis
        if key not in axes_of:
            axes_of[key] = _int64_constant(graph, "pointwise_last_axis" if along_rows else f"pointwise_axis_{axis}", [key])
        axes = axes_of[key]
        peak = ir.node("ReduceMax", [x, axes], attributes={"keepdims": 1})
        peak.meta[_SOFTMAX_MAX] = along_rows  # another axis's max stays ORT's (its NaN: see row_reduction_shape)
        shifted = ir.node("Sub", [x, peak.outputs[0]])
        exp = ir.node("Exp", [shifted.outputs[0]])
        total = ir.node("ReduceSum", [exp.outputs[0], axes], attributes={"keepdims": 1})
        if node.op_type == "Softmax":
            steps = [peak, shifted, exp, total, ir.node("Div", [exp.outputs[0], total.outputs[0]])]
        else:
            log = ir.node("Log", [total.outputs[0]])
            steps = [peak, shifted, exp, total, log, ir.node("Sub", [shifted.outputs[0], log.outputs[0]])]
        for step in steps:
            step.outputs[0].dtype = ir.DataType.FLOAT
            if static or not along_rows:  # what the groups read their operands' layouts from
                reduced = step.op_type in ("ReduceMax", "ReduceSum", "Log")
                step.outputs[0].shape = ir.Shape([1 if reduced and d == axis else n for d, n in enumerate(shape)])
        _replace_node(graph, node, steps, "unexpanded")


def _mark_softmax_written_out(graph: ir.Graph) -> None:
    """The max of a softmax written out (``_fusions.softmax_written_out``) is marked as an
    expanded Softmax's is, so that it fuses into the kernel with the rest."""
    for node in graph:
        if _softmax_written_out(node):
            node.meta[_SOFTMAX_MAX] = True


def _users(value: ir.Value, op_type: str, operand) -> list[ir.Node]:
    """The binary ``op_type`` nodes reading ``value`` whose other input is ``operand``: a
    number (a constant of that value) or a value itself."""
    def matches(other):
        return other is operand if isinstance(operand, ir.Value) else _is(other, operand)

    return [u.node for u in value.uses() if _op(u.node, op_type) and matches(_other(u.node, value))]


def _follow(value: ir.Value, steps: list[tuple]) -> list[ir.Node] | None:
    """The first chain of nodes (depth first) that computes ``steps`` from ``value``, each
    reading the previous one's output: a step ``(op_type, operand)`` is a binary op whose other
    input is ``operand`` (as in ``_users``), or, with ``operand`` None, a unary op."""
    if not steps:
        return []
    op_type, operand = steps[0]
    candidates = [u.node for u in value.uses() if _op(u.node, op_type)] if operand is None \
        else _users(value, op_type, operand)
    for node in candidates:
        rest = _follow(node.outputs[0], steps[1:])
        if rest is not None:
            return [node, *rest]
    return None


def _erf_cdf(x: ir.Value) -> list[ir.Node] | None:
    """The nodes computing ``0.5 * (1 + Erf(x * sqrt(0.5)))`` from ``x`` (GELU's backward
    has them), last first, if the graph has them."""
    chain = _follow(x, [("Mul", math.sqrt(0.5)), ("Erf", None), ("Add", 1.0), ("Mul", 0.5)])
    return chain[::-1] if chain else None


def _tanh_gelu_parts(x: ir.Value) -> list[ir.Node] | None:
    """The nodes of tanh-GELU's backward (torch's decomposition) that depend on ``x`` alone:
    ``sq = x*x``, ``Tanh((x + sq*x*kappa) * beta)``, ``half_x = x*0.5``, ``shifted = tanh + 1``;
    returned as ``[sq, tanh, half_x, shifted, ...the rest of the chain to Tanh]``, or None."""
    chain = _follow(x, [("Mul", x), ("Mul", x), ("Mul", _TANH_GELU_KAPPA), ("Add", x),
                        ("Mul", _TANH_GELU_BETA), ("Tanh", None), ("Add", 1.0)])
    halves = _users(x, "Mul", 0.5)
    if chain is None or not halves:
        return None
    sq, cube, kappa, total, beta, tanh, shifted = chain
    return [sq, tanh, halves[0], shifted, beta, total, kappa, cube]


def _gelus_as_arithmetic(graph: ir.Graph, info: _Graph) -> int:
    """A GELU recomputed in backward (``memory_opt_level=1``: the next Linear's weight gradient
    reads it) becomes arithmetic over what its backward computes anyway: ``x * cdf`` over the
    erf's cdf (``Gelu``), ``(x/2) * (1 + tanh)`` over the tanh (``FastGelu``, GPT-2's). One
    kernel then computes both from ``x``, and Erf or Tanh runs once, where ORT's op would be a
    pass of its own, with Erf or Tanh again. So does one after an elementwise op (the forward's:
    a Linear's bias added after its view): one kernel then adds the bias and applies GELU, one
    pass where ORT's Add and GELU were two."""
    count, constants = 0, {}

    def constant(number: float) -> ir.Value:
        if number not in constants:
            constants[number] = _initializer(graph, f"pointwise_gelu_{len(constants)}", np.array(number, dtype=np.float32))
        return constants[number]

    for gelu in [n for n in graph if n.domain == _MS and n.op_type in ("Gelu", "FastGelu") and len(n.inputs) == 1]:
        x = gelu.inputs[0]
        shape = info.dims(x) if x is not None and x.dtype == ir.DataType.FLOAT else None
        old_chain = (_erf_cdf(x) if gelu.op_type == "Gelu" else _tanh_gelu_parts(x)) if shape else None
        source = x.producer() if shape else None
        # Only where the kernel is made: too small a chain (below) would stay written out.
        after_elementwise = source is not None and source.domain in ("", "ai.onnx") and source.op_type in _BINARY \
            and not _below_kernel_size(shape)
        if old_chain is None and not after_elementwise:
            continue
        # Built at the GELU's place, before the backward's own chain, which then reads it.
        if gelu.op_type == "Gelu":
            scale = ir.node("Mul", [x, constant(math.sqrt(0.5))])
            erf = ir.node("Erf", [scale.outputs[0]])
            shifted = ir.node("Add", [erf.outputs[0], constant(1.0)])
            cdf = ir.node("Mul", [shifted.outputs[0], constant(0.5)])
            steps = [scale, erf, shifted, cdf, ir.node("Mul", [x, cdf.outputs[0]])]
            shared = [(old_chain[0], cdf)] if old_chain else []
        else:
            sq = ir.node("Mul", [x, x])
            cube = ir.node("Mul", [sq.outputs[0], x])
            kappa = ir.node("Mul", [cube.outputs[0], constant(_TANH_GELU_KAPPA)])
            total = ir.node("Add", [x, kappa.outputs[0]])
            beta = ir.node("Mul", [total.outputs[0], constant(_TANH_GELU_BETA)])
            tanh = ir.node("Tanh", [beta.outputs[0]])
            shifted = ir.node("Add", [tanh.outputs[0], constant(1.0)])
            half_x = ir.node("Mul", [x, constant(0.5)])
            steps = [sq, cube, kappa, total, beta, tanh, shifted, half_x,
                     ir.node("Mul", [half_x.outputs[0], shifted.outputs[0]])]
            shared = list(zip(old_chain[:4], (sq, tanh, half_x, shifted))) if old_chain else []
        for step in steps:
            step.outputs[0].dtype = ir.DataType.FLOAT
        _replace_node(graph, gelu, steps, "unexpanded")
        for old, new in shared:
            _take_over(old.outputs[0], new.outputs[0], "unshared")
        if old_chain:
            _remove_if_dead(graph, old_chain)
        count += 1
    return count


def _transposed_reads(inputs: list[ir.Value], members: set[ir.Node], info: _Graph, rank: int):
    """Inputs that only the kernel reads, through a Transpose: the kernel reads the
    Transpose's input at transposed strides, and the Transpose is left dead. Returns the
    kernel node's inputs and ``{index: iteration axis -> axis in memory}``."""
    sources, perms = list(inputs), {}
    for index, value in enumerate(inputs):
        transpose = value.producer()
        if transpose is None or transpose.op_type != "Transpose" or transpose.domain not in ("", "ai.onnx") \
                or "perm" not in transpose.attributes or value.is_graph_output() \
                or any(use.node not in members for use in value.uses()) or info.dims(transpose.inputs[0]) is None:
            continue
        perm = [int(p) for p in transpose.attributes["perm"].value]
        pad = rank - len(perm)
        if perm != list(range(len(perm))):  # an identity (a permute to the same order) reads as it is
            perms[index] = tuple(range(pad)) + tuple(pad + p for p in perm)
        sources[index] = transpose.inputs[0]
    return sources, perms


def _transposed_writes(outputs: list[ir.Value], rank: int):
    """Full outputs that only a Transpose keeping the last axis reads: the kernel writes each
    row where the Transpose would have put it. Returns the values the kernel's outputs replace
    and ``{index: iteration axis -> axis in memory}``."""
    targets, perms = list(outputs), {}
    for index, value in enumerate(outputs):
        producer, uses = value.producer(), value.uses()
        if value.is_graph_output() or len(uses) != 1 or _row_reduction(producer) or _column_sum(producer):
            continue
        transpose = uses[0].node
        perm = _perm_keeping_last_axis(transpose)
        if perm is None or len(perm) != rank:
            continue
        # An identity (PyTorch's permute to the same order) is written as it is: with a perm the
        # kernel iterates by the last axis, 1.8 ns an element over unfold's rows of 4 (7.6 ms).
        if perm != list(range(rank)):
            perms[index] = tuple(perm.index(d) for d in range(rank))
        targets[index] = transpose.outputs[0]
    return targets, perms


def _inverse_transposes_removed(graph: ir.Graph) -> int:
    """``Transpose(Transpose(x, p), q)`` where q undoes p -> x (a partition's input in a layout
    it moves back, as a kernel wrote it in the partition before; ORT's optimizer would cancel
    the pair, but not once they are MergeHeads). Returns the count."""
    removed = 0
    for node in list(graph):
        first = node.inputs[0].producer() if _op(node, "Transpose") and node.inputs else None
        if not _op(first, "Transpose") or node.outputs[0].is_graph_output():
            continue
        p, q = (list(n.attributes.get_ints("perm", [])) for n in (first, node))
        if not p or len(p) != len(q) or any(p[q[i]] != i for i in range(len(q))):
            continue
        node.outputs[0].replace_all_uses_with(first.inputs[0])
        _remove_if_dead(graph, [node, first])
        removed += 1
    return removed


def fuse_pointwise(model: ir.Model, bfloat16_products=lambda: False, device: str = "cpu",
                   own_attention: bool = True, float32_products=None) -> list[str]:
    """Replace elementwise groups of ``model``'s main graph by ``ort_dynamo.pointwise`` nodes,
    and, where ``bfloat16_products()`` says the compiler can build them, CPU autocast's products
    by bfloat16 ones; where ``float32_products()`` does (``bfloat16_products`` if not given),
    float32 products with a long inner dimension or few rows, and convolutions, by ours; with
    ``own_attention``, torch's flash attention ops by ort_dynamo's attention kernels. Returns each
    new kernel's code (an empty list if nothing was fused): C for the CPU, CUDA C for ``device``
    "cuda" (``is_cuda``), where elementwise chains and their row sums become kernels."""
    if device == "cuda":
        return _fuse_for_cuda(model)
    graph = model.graph
    _inverse_transposes_removed(graph)
    attentions = _op_kernels.attentions_as_kernels(graph, _torch_attention.DOMAIN) if own_attention else []
    if attentions and not any(node.domain == _torch_attention.DOMAIN for node in graph):
        model.opset_imports.pop(_torch_attention.DOMAIN, None)  # torch's library: not needed then
    softmaxes = _op_kernels.axis_softmaxes_as_kernels(graph)
    if softmaxes:  # the chains they replace, dead now, must not become kernels below
        ir.passes.common.RemoveUnusedNodesPass()(model)
    _expand_softmax(graph, _Graph())
    _mark_softmax_written_out(graph)
    _gelus_as_arithmetic(graph, _Graph())
    _fold_rotate_half(graph, _Graph())
    if _elementwise_before_reshapes(graph, _Graph()):
        _consecutive_reshapes(graph, _Graph())
    _chains_in_their_source_shape(graph, _Graph())
    _column_sums_through_reshapes(graph, _Graph())
    _widen_before_views(graph)  # after the passes above, which add views
    _bias_into_rounding(graph)
    kernels = attentions + softmaxes + _op_kernels.bf16_matmuls_as_kernels(graph, bfloat16_products)
    float32_products = float32_products or bfloat16_products
    kernels += _op_kernels.f32_matmuls_as_kernels(graph, float32_products)
    kernels += _op_kernels.conv_weight_grads_as_kernels(graph, float32_products)
    kernels += _op_kernels.convs_as_kernels(graph, float32_products)
    into_zeros = _scatter_add_rows(graph, _Graph())
    kernels += [_SCATTER_ADD_ROWS] if not all(into_zeros) else []
    kernels += [_SCATTER_ADD_ROWS_TO_ZEROS] if any(into_zeros) else []
    pools = _op_kernels.gathered_max_pools_as_kernels(graph) + _op_kernels.max_pools_as_kernels(graph)
    if pools:  # the portable chains, dead now, must not become kernels below
        ir.passes.common.RemoveUnusedNodesPass()(model)
    kernels += pools
    kernels += _op_kernels.group_convs_as_kernels(graph)
    if _op_kernels.scatter_adds_along_last_axis(graph, _constant_zeros, _replace_node):
        kernels.append(_op_kernels.SCATTER_ADD_LAST_AXIS)
    kernels += _op_kernels.split_heads_as_kernels(graph)
    groups, info = _groups(graph)
    repeats = collections.Counter(_chain(group) for group in groups)

    def small(group: _Group) -> bool:
        return _below_kernel_size(group.shape) and repeats[_chain(group)] < MIN_REPEATS

    kernels += _fuse_groups(graph, [g for g in groups if not small(g)], info, cuda=False)
    kernels += _op_kernels.merged_heads_as_kernels(graph)
    kernels += _op_kernels.slow_transposes_as_kernels(graph)
    _op_kernels.slow_expands_as_products(graph)
    _unfold_rotate_half(graph)
    if kernels:
        model.opset_imports[DOMAIN] = 1
        graph.sort()
    return list(dict.fromkeys(kernels))


def _fuse_groups(graph: ir.Graph, groups: list[_Group], info: _Graph, cuda: bool) -> list[str]:
    """Each group that can be (inputs, outputs and shapes permitting) becomes one kernel node;
    returns the kernels' code. ``cuda``: CUDA C, of elementwise groups only."""
    kernels: list[str] = []
    output_positions = {value: i for i, value in enumerate(graph.outputs)}
    # Replaced nodes leave the graph together at the end: each removal scans every graph
    # output. They stop reading their inputs at once, so later groups see only live uses.
    replaced: list[ir.Node] = []

    def replace(node: ir.Node) -> None:
        for i in range(len(node.inputs)):
            node.replace_input_with(i, None)
        replaced.append(node)

    literal_types = (ir.DataType.FLOAT, *_HALF_TYPES) if cuda else (ir.DataType.FLOAT,)
    for group in groups:
        members = set(group.nodes)
        _without_escaping_per_row_values(group, members)
        if not group.nodes:
            continue
        alone = len(group.nodes) < 2 and group.nodes[0].op_type not in _ALONE_OK and not _column_sum(group.nodes[0])
        produced = {node.outputs[0] for node in group.nodes}
        inputs: list[ir.Value] = []
        for node in group.nodes:
            for position, value in enumerate(node.inputs):
                if value is None or value in produced or value in inputs:
                    continue
                is_operand = not (position == 1 and node.op_type in ("Pow", "Expand", *_ROW_REDUCTIONS))
                if not is_operand:
                    continue
                if value.dtype in literal_types and _scalar(value) is not None and \
                        (info.dims(value) is None or all(d == 1 for d in info.dims(value))):
                    continue  # a literal in the C code
                inputs.append(value)
        outputs = [v for v in produced if v.is_graph_output() or any(u.node not in members for u in v.uses())]
        outputs.sort(key=lambda v: group.nodes.index(v.producer()))
        if not inputs or not outputs or len(inputs) > _MAX_ARGS or len(outputs) > _MAX_ARGS:
            continue
        if _broadcast([info.dims(v) for v in inputs]) != group.shape:
            continue  # the iteration shape must follow from the inputs at run time
        if cuda:
            if alone:
                continue  # one op: ORT's CUDA kernel is as good
            sources, perms, targets, out_perms = inputs, {}, outputs, {}
            code = _emit_cuda(group, inputs, outputs, "pw_@")
        else:
            sources, perms = _transposed_reads(inputs, members, info, len(group.shape))
            targets, out_perms = _transposed_writes(outputs, len(group.shape))
            takes_a_transpose = sources != inputs or targets != outputs  # identities included
            if alone and not _worth_a_kernel_alone(group.nodes[0], takes_a_transpose):
                continue
            code = _emit(group, info, inputs, outputs, "pw_@", perms, out_perms)
        # Named by the hash of its code: identical chains (one per layer) share one kernel.
        name = "pw_" + hashlib.sha256(code.encode()).hexdigest()[:16]
        kernels.append(code.replace("pw_@", name))
        fused = ir.node(name, sources, domain=DOMAIN, num_outputs=len(outputs),
                        doc_string="|".join(n.op_type for n in group.nodes))
        graph.insert_after(group.nodes[-1], fused)
        for old, new in zip(targets, fused.outputs):
            written_by = old.producer() if old not in outputs else None  # a Transpose written in place
            info.shape[new] = info.dims(old)  # for later groups reading it: inferred, if not annotated
            _take_over(old, new, "unfused", output_positions)
            if written_by is not None:
                replace(written_by)
        for node in group.nodes:
            replace(node)
    graph.remove(replaced, safe=True)
    return kernels


# -- the GPU's kernels ----------------------------------------------------------------------------

_CUDA_MARK = "// ort_dynamo CUDA kernel "
_ONNX_TYPE = {ir.DataType.FLOAT: 1, ir.DataType.BOOL: 9, ir.DataType.FLOAT16: 10, ir.DataType.BFLOAT16: 16}
#: Per 16-bit type: its load as float32, its rounding, its bits to store.
_HALF_C = {ir.DataType.BFLOAT16: ("pw_bf16_to_float", "pw_round_bf16", "pw_bf16_bits"),
           ir.DataType.FLOAT16: ("pw_f16_to_float", "pw_round_f16", "pw_f16_bits")}


def is_cuda(kernel: str) -> bool:
    """Whether ``kernel`` (as ``fuse_pointwise`` returns it) is CUDA C."""
    return kernel.startswith(_CUDA_MARK)


def _fuse_for_cuda(model: ir.Model) -> list[str]:
    """On the GPU, every chain of two or more elementwise ops (float32, bfloat16 or float16),
    with the row sums between them, becomes one kernel: ORT's CUDA provider runs each op as a
    launch and a pass over memory of its own, and stock ONNX Runtime has no fused gradient
    kernels. Column sums, products and the rest stay ORT's."""
    graph = model.graph
    groups, info = _groups(graph, _Graph(half_ops=True), reductions="rows")
    kernels = _fuse_groups(graph, groups, info, cuda=True)
    if kernels:
        model.opset_imports[DOMAIN] = 1
        graph.sort()
    return list(dict.fromkeys(kernels))


def _emit_cuda(group: _Group, inputs: list[ir.Value], outputs: list[ir.Value], name: str) -> str:
    """CUDA C of one kernel (``csrc/pointwise_cuda.h`` has the rest), reading each input where
    broadcasting puts it. Elementwise only: each thread computes whole elements. With row sums
    (a norm's or a softmax's backward): a block per row, in phases as on the CPU (``_phases``),
    each ending with its sums added up across the block. A 16-bit op's result is rounded as it
    would be in memory, so a fused chain gives ORT's (and torch's) values. The first line holds
    what the host library needs: name, element types, and for a row kernel each output's kind."""
    arg = {v: f"x{i}" for i, v in enumerate(inputs)}
    local = {node.outputs[0]: (f"s{i}" if _row_reduction(node) else f"t{i}") for i, node in enumerate(group.nodes)}

    def ref(value):
        return local.get(value) or arg.get(value) or _literal(_scalar(value))

    ctype = {ir.DataType.BOOL: "uint8_t", ir.DataType.BFLOAT16: "uint16_t", ir.DataType.FLOAT16: "uint16_t"}
    loads = []
    for i, v in enumerate(inputs):
        element = f"(({ctype.get(v.dtype, 'float')} const*)a.in[{i}])[pw_index(a, {i}, e)]"
        if v.dtype in _HALF_C:
            loads.append(f"const float {arg[v]} = {_HALF_C[v.dtype][0]}({element});")
        else:
            loads.append(f"const {ctype.get(v.dtype, 'float')} {arg[v]} = {element};")

    def statement(node):
        if _row_reduction(node):
            return f"{local[node.outputs[0]]} += {ref(node.inputs[0])};"
        expr = _expression(node, ref)
        if node.outputs[0].dtype in _HALF_C and node.op_type != "Cast":  # a Cast rounds in _expression
            expr = f"{_HALF_C[node.outputs[0].dtype][1]}({expr})"
        return f"const float {local[node.outputs[0]]} = {expr};"

    out_kind = [1 if _row_reduction(v.producer()) else 0 for v in outputs]
    stores = [f"((uint16_t*)a.out[{j}])[e] = {_HALF_C[v.dtype][2]}({local[v]});" if v.dtype in _HALF_C
              else f"((float*)a.out[{j}])[e] = {local[v]};" for j, v in enumerate(outputs) if out_kind[j] == 0]
    reductions = [n for n in group.nodes if _row_reduction(n)]
    meta = {"name": name, "in": [_ONNX_TYPE[v.dtype] for v in inputs], "out": [_ONNX_TYPE[v.dtype] for v in outputs]}
    if not reductions:
        body = loads + [statement(n) for n in group.nodes] + stores
        return "\n".join([_CUDA_MARK + json.dumps(meta), "template <typename I>",
                          f"static __device__ __forceinline__ void {name}_body(const PwCudaArgs& a, I e) {{",
                          *["  " + line for line in body], "}", f"PW_CUDA_ENTRY({name})"]) + "\n"
    meta["out_kinds"] = out_kind
    phase = _phases(group)
    last = max(phase.values())
    body = ["const I n = (I)a.dims[a.rank - 1], e0 = r * n;"]
    finals = [v.producer() for v, kind in zip(outputs, out_kind) if kind == 0]
    for k, closing, per_row, lanes in _phase_plan(group, phase, finals):
        # Values per row: once, before the lanes (their sums are complete by now).
        body += [statement(n) for n in per_row]
        body += [f"float {local[n.outputs[0]]} = 0.0f;" for n in closing]
        if lanes or closing or (k == last and stores):
            body += ["for (I i = threadIdx.x; i < n; i += blockDim.x) {", "  const I e = e0 + i;"]
            body += ["  " + line for line in loads + [statement(n) for n in lanes + closing]
                     + (stores if k == last else [])]
            body.append("}")
        for n in closing:
            body.append(f"{local[n.outputs[0]]} = pw_block_sum({local[n.outputs[0]]}, scratch);")
            if n.op_type == "ReduceMean":
                body.append(f"{local[n.outputs[0]]} /= (float)n;")
        body += [f"if (threadIdx.x == 0) ((float*)a.out[{j}])[r] = {local[v]};" for j, v in enumerate(outputs)
                 if out_kind[j] == 1 and phase[v.producer()] == k]
    return "\n".join([_CUDA_MARK + json.dumps(meta), "template <typename I>",
                      f"static __device__ __forceinline__ void {name}_row(const PwCudaArgs& a, I r, float* scratch) {{",
                      *["  " + line for line in body], "}", f"PW_CUDA_ROW_ENTRY({name})"]) + "\n"


def cuda_table_source(kernels: list[str]) -> str:
    """The host C of a CUDA library's kernel definitions (``csrc/pointwise_cuda_runtime.c``
    registers them); the binary, ``pw_cuda_image``, comes with it from ``_kernels``."""
    lines = ['#include "pointwise_cuda.h"']
    names = []
    for kernel in kernels:
        meta = json.loads(kernel.splitlines()[0][len(_CUDA_MARK):])
        n = meta["name"]
        names.append(n)
        kinds = meta.get("out_kinds")
        lines += [f"static const int {n}_in[] = {{{', '.join(map(str, meta['in']))}}};",
                  f"static const int {n}_out[] = {{{', '.join(map(str, meta['out']))}}};",
                  *([f"static const int {n}_out_kinds[] = {{{', '.join(map(str, kinds))}}};"] if kinds else []),
                  f'static const PwCudaKernelDef {n}_def = {{"{n}", {len(meta["in"])}, {n}_in, '
                  f'{len(meta["out"])}, {n}_out, {1 if kinds else 0}, {f"{n}_out_kinds" if kinds else "0"}}};']
    lines.append(f"const PwCudaKernelDef* const pw_cuda_kernels[] = {{{''.join(f'&{n}_def, ' for n in names)}0}};")
    return "\n".join(lines) + "\n"
