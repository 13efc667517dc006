"""Lower: rewrite the Dynamo graph and pick the decompositions AOTAutograd applies.

Goal: every op that reaches the partitioner either has an ONNX lowering in torchlib
or is decomposed into ops that do. Two mechanisms:

* ``lower_graph`` rewrites the torch-level Dynamo graph before AOTAutograd. Needed for
  ops whose backward autograd would record as a fused kernel with no ONNX lowering
  (SDPA's flash/efficient attention backward, 2-D grid sampling's backward): replaced by
  math, autograd derives a backward made of matmul/softmax/gathers.
* ``decomposition_table`` is handed to AOTAutograd: torch's decompositions for ops
  torchlib lacks (most ``*_backward`` ops) plus our own for those torch has none of.
  ``whole_upsampling`` is the context AOTAutograd traces in, so that the table, not a
  decomposition torch applies above autograd, decides how upsampling is written;
  ``trainable_rnns`` another, so that an LSTM is unrolled into ops autograd can differentiate.
"""

from __future__ import annotations

import contextlib
import functools
import math
import operator
import threading

import torch
import torch.fx
from torch._decomp import _core_aten_decompositions_post_autograd, decomposition_table as _torch_decompositions
from torch._export.utils import _is_preservable_cia_op
from torch.export.decomp_utils import PRESERVED_ATEN_CIA_OPS

from ._op_kernels import ATTENTION_HEAD_MULTIPLE
from .decompositions import (size_hint, _known, attention_backward, attention_forward, attention_inputs, attention_operands,
                             masked_scores, own_decompositions, pointwise_decompositions, product_decompositions,
                             zero_rows)

__all__ = ["lower_graph", "decomposition_table", "whole_upsampling", "trainable_rnns", "stacked_row_gradients",
           "unit_sums_removed", "random_draws_in_pytorch", "sizes_from_inputs", "squeezes_as_traced", "IN_PYTORCH"]

aten = torch.ops.aten


def sdpa_math(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
              enable_gqa=False):
    """``F.scaled_dot_product_attention`` in ops ONNX has, differentiable by autograd."""
    key, value, scale, _ = attention_inputs(query, key, value, scale, enable_gqa)
    scores, empty = masked_scores(torch.matmul(query, key.transpose(-2, -1)) * scale, attn_mask, is_causal)
    probs = zero_rows(torch.softmax(scores, dim=-1), empty)
    if dropout_p > 0.0:
        probs = torch.nn.functional.dropout(probs, p=dropout_p, training=True)
    return torch.matmul(probs, value)


class _AttentionRecomputed(torch.autograd.Function):
    """softmax(q kᵀ·scale + mask) v that saves each row's logsumexp instead of the
    probabilities; backward recomputes them, as flash attention's does
    (``decompositions.attention_forward``/``attention_backward``). Per layer that is [batch,
    heads, q, kv] floats less to keep, for one more batched product in backward."""

    @staticmethod
    def forward(ctx, query, key, value, mask, scale, is_causal, dropout_p):
        q, k_t, v, batch = attention_operands(query, key, value)
        out, logsumexp, keep = attention_forward(q, k_t, v, mask, scale, is_causal, batch, dropout_p)
        ctx.save_for_backward(q, k_t, v, mask, logsumexp, keep)
        ctx.scale, ctx.is_causal, ctx.batch, ctx.dropout_p = scale, is_causal, batch, dropout_p
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k_t, v, mask, logsumexp, keep = ctx.saved_tensors
        with _without_autocast(q.device.type):  # the dtypes forward chose, whatever the caller's
            grads = attention_backward(grad_out, q, k_t, v, mask, logsumexp, ctx.scale, ctx.is_causal, ctx.batch,
                                       keep, ctx.dropout_p)
        return (*grads, None, None, None, None)


def _without_autocast(device_type: str):
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def _autocast_operand(tensor, dtype):
    """What autocast hands a lower-precision op (SDPA is one): floating tensors but float64 cast."""
    if tensor is None or not tensor.is_floating_point() or tensor.dtype == torch.float64:
        return tensor
    return tensor.to(dtype)


def sdpa_recomputed(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                    enable_gqa=False):
    """``sdpa_math`` that keeps no probabilities for backward (``memory_opt_level=1``). Under
    autocast it takes the operands in autocast's dtype, as torch's SDPA does, and runs without
    autocast, so that backward recomputes in the dtypes forward used. With dropout it keeps the
    mask of what it kept, one byte per probability."""
    device = query.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        query, key, value, attn_mask = (_autocast_operand(t, dtype) for t in (query, key, value, attn_mask))
        with torch.autocast(device, enabled=False):
            return sdpa_recomputed(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    dtypes = {query.dtype, key.dtype, value.dtype}
    if (not 0.0 <= dropout_p < 1.0 or len(dtypes) != 1 or not next(iter(dtypes)).is_floating_point or query.dim() < 3
            or (attn_mask is not None and attn_mask.requires_grad)):
        return sdpa_math(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    key, value, scale, _ = attention_inputs(query, key, value, scale, enable_gqa)
    if not (query.shape[:-2] == key.shape[:-2] == value.shape[:-2]):  # broadcast batch dims
        return sdpa_math(query, key, value, attn_mask, dropout_p, is_causal, scale)
    return _AttentionRecomputed.apply(query, key, value, attn_mask, scale, is_causal, dropout_p)


class _AttentionAs(torch.overrides.TorchFunctionMode):
    """Inside a function Dynamo keeps whole: its ``scaled_dot_product_attention`` calls as
    ``sdpa``. A mode, not a patched module global: it holds for this thread's call only."""

    def __init__(self, sdpa):
        super().__init__()
        self.sdpa = sdpa

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch._C._nn.scaled_dot_product_attention, torch.nn.functional.scaled_dot_product_attention):
            return self.sdpa(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


def multi_head_attention_math(*args, **kwargs):
    """``F.multi_head_attention_forward`` (``nn.MultiheadAttention``, ``nn.Transformer*``),
    which Dynamo keeps whole, with its attention as ``sdpa_math``: otherwise SDPA dispatches
    to the device's flash kernel inside it (CUDA's runs in PyTorch, ``TORCHLIB_FAKE_LOGSUMEXP``)."""
    with _AttentionAs(sdpa_math):
        return torch.nn.functional.multi_head_attention_forward(*args, **kwargs)


def multi_head_attention_recomputed(*args, **kwargs):
    """``multi_head_attention_math`` with ``sdpa_recomputed`` (``memory_opt_level=1``)."""
    with _AttentionAs(sdpa_recomputed):
        return torch.nn.functional.multi_head_attention_forward(*args, **kwargs)


_GRID_MODES = {"bilinear": 0, "nearest": 1, "bicubic": 2}
_GRID_PADDINGS = {"zeros": 0, "border": 1, "reflection": 2}


def grid_sampler_2d_math(input, grid, interpolation_mode=0, padding_mode=0, align_corners=False):
    """2-D ``grid_sampler`` as torch's reference decomposition (gathers and arithmetic), so
    autograd derives its backward: ``grid_sampler_2d_backward`` has no ONNX lowering."""
    from torch._decomp.decompositions import grid_sampler_2d

    return grid_sampler_2d(input, grid, interpolation_mode, padding_mode, align_corners)


def _source_coordinate(coord, size: int, padding_mode: int, align_corners: bool):
    """Grid coordinate in [-1, 1] -> input position, with eager's border/reflection rules."""
    # Same operations in the same order as eager's GridSampler.h, so that rounding, and the
    # cell each point falls in, agree.
    if align_corners:
        pos = (coord + 1) / 2 * (size - 1)
    else:
        pos = ((coord + 1) * size - 1) / 2
    if padding_mode == 0:
        return pos
    if padding_mode == 2:  # reflect about the borders (corner centers or edges), then clip
        low, span = (0.0, size - 1.0) if align_corners else (-0.5, float(size))
        if span <= 0:
            pos = torch.zeros_like(pos)
        else:
            away = (pos - low).abs()
            extra = torch.fmod(away, span)
            even = (away / span).floor().remainder(2) == 0
            pos = torch.where(even, extra + low, (span - extra) + low)
    return pos.clamp(0, size - 1)


def grid_sampler_3d_math(input, grid, interpolation_mode=0, padding_mode=0, align_corners=False):
    """``grid_sampler_3d`` (trilinear / nearest) as gathers and arithmetic, so that autograd
    derives the backward; neither direction has an ONNX lowering. Half types compute in
    float32, as eager's kernels accumulate."""
    if interpolation_mode not in (0, 1) or padding_mode not in (0, 1, 2):
        return torch.grid_sampler_3d(input, grid, interpolation_mode, padding_mode, align_corners)
    dtype = input.dtype
    a, g = (input.float(), grid.float()) if dtype in (torch.float16, torch.bfloat16) else (input, grid)
    n, c, *sizes = a.shape
    out_shape = g.shape[1:4]
    flat = a.reshape(n, c, -1)
    # grid's last dim is (x, y, z) = (W, H, D): reversed against the input's dims.
    pos = [_source_coordinate(g[..., 2 - k], sizes[k], padding_mode, align_corners) for k in range(3)]

    def sample(index, weight):
        inside = torch.ones_like(index[0], dtype=torch.bool)
        for i, size in zip(index, sizes):
            inside = inside & (i >= 0) & (i < size)
        flat_index = (index[0] * sizes[1] + index[1]) * sizes[2] + index[2]
        flat_index = torch.where(inside, flat_index, 0).reshape(n, 1, -1).expand(n, c, -1)
        weight = torch.where(inside, weight, torch.zeros((), dtype=weight.dtype, device=weight.device))
        return flat.gather(2, flat_index) * weight.reshape(n, 1, -1)

    if interpolation_mode == 1:  # nearest: round half to even, as nearbyint
        index = [p.round().to(torch.int64) for p in pos]
        out = sample(index, torch.ones_like(pos[0]))
    else:
        low = [p.floor() for p in pos]
        out = None
        for corner in range(8):
            bits = [(corner >> (2 - k)) & 1 for k in range(3)]
            index = [(lo + b).to(torch.int64) for lo, b in zip(low, bits)]
            weight = None
            for p, lo, b in zip(pos, low, bits):
                w = (p - lo) if b else (lo + 1 - p)
                weight = w if weight is None else weight * w
            term = sample(index, weight)
            out = term if out is None else out + term
    return out.reshape(n, c, *out_shape).to(dtype)


def grid_sampler_math(input, grid, interpolation_mode=0, padding_mode=0, align_corners=False):
    if input.dim() == 5:
        return grid_sampler_3d_math(input, grid, interpolation_mode, padding_mode, align_corners)
    if input.dim() != 4:
        return torch.grid_sampler(input, grid, interpolation_mode, padding_mode, align_corners)
    return grid_sampler_2d_math(input, grid, interpolation_mode, padding_mode, align_corners)


def grid_sample_math(input, grid, mode="bilinear", padding_mode="zeros", align_corners=None):
    if input.dim() not in (4, 5) or mode not in _GRID_MODES or padding_mode not in _GRID_PADDINGS:
        return torch.nn.functional.grid_sample(input, grid, mode, padding_mode, align_corners)
    return grid_sampler_math(input, grid, _GRID_MODES[mode], _GRID_PADDINGS[padding_mode],
                             bool(align_corners))


def _chunked_cross_entropy(input, linear_weight, target, linear_bias, weight, reduction, ignore_index,
                           label_smoothing, acc_dtype):
    logits = torch.nn.functional.linear(input, linear_weight, linear_bias)
    logits = logits.reshape(-1, logits.shape[-1]).to(acc_dtype)
    loss = torch.nn.functional.cross_entropy(
        logits, target.reshape(-1), weight=None if weight is None else weight.to(acc_dtype),
        reduction=reduction, ignore_index=ignore_index, label_smoothing=label_smoothing)
    return loss.to(input.dtype)


def linear_cross_entropy_chunked_math(input, linear_weight, target, linear_bias, weight, reduction,
                                      ignore_index, label_smoothing, batch_chunk_size, acc_policy,
                                      acc_dtype, *compute_flags):
    """``F.linear_cross_entropy``'s chunked op (loss plus gradients precomputed in the forward,
    an opaque custom op) as ``cross_entropy(linear(...))``: autograd derives the gradients.
    Unchunked, so the full logits are materialized. The precomputed-gradient outputs are None:
    only the loss is ever read (``F.linear_cross_entropy`` takes element 0)."""
    loss = _chunked_cross_entropy(input, linear_weight, target, linear_bias, weight, reduction,
                                  ignore_index, label_smoothing, acc_dtype)
    return loss, None, None, None


def linear_cross_entropy_chunked_none_math(input, linear_weight, target, linear_bias, weight,
                                           ignore_index, batch_chunk_size, acc_policy, acc_dtype):
    return _chunked_cross_entropy(input, linear_weight, target, linear_bias, weight, "none",
                                  ignore_index, 0.0, acc_dtype)


def _leading_mask(x, index, value):
    """``index``'s bool tensor when ``x[index] = value`` puts one ``value`` (a number, or a
    tensor that broadcasts to a masked row) at every place of a bool mask over ``x``'s leading
    dims; else None."""
    mask = index[0] if isinstance(index, (tuple, list)) and len(index) == 1 else index
    if not (isinstance(x, torch.Tensor) and isinstance(mask, torch.Tensor) and mask.dtype == torch.bool
            and mask.device == x.device and 0 < mask.dim() <= x.dim()
            and tuple(mask.shape) == tuple(x.shape[:mask.dim()])):
        return None
    if isinstance(value, torch.Tensor):
        row = tuple(x.shape[mask.dim():])
        if value.dim() > len(row) or torch.broadcast_shapes(value.shape, row) != row:
            return None
    elif not isinstance(value, (bool, int, float)):
        return None
    return mask.reshape(*mask.shape, *[1] * (x.dim() - mask.dim()))


def masked_setitem(x, index, value):
    """``x[mask] = value`` with one value for every masked place, as ``x.copy_(where(...))``.
    Eager's form gathers the masked places (``nonzero``), whose count only the data gives, so
    AOTAutograd could not trace a graph where ``value`` needs a gradient; ``where`` has static
    shapes, forward and backward. Any other assignment is left as it was."""
    mask = _leading_mask(x, index, value)
    if mask is None:
        return operator.setitem(x, index, value)
    value = value.to(x.dtype) if isinstance(value, torch.Tensor) else x.new_full((), value)
    x.copy_(torch.where(mask, value, x))


def masked_index_put(x, indices, values, accumulate=False):
    """``torch.index_put`` by one bool mask with one value for every masked place, as a
    ``where`` (``masked_setitem``'s reason)."""
    mask = _leading_mask(x, indices, values)
    if mask is None or not isinstance(values, torch.Tensor) or values.dtype != x.dtype:
        return torch.index_put(x, indices, values, accumulate)
    return torch.where(mask, x + values if accumulate else values, x)


_DYNAMO_REWRITES = {
    torch._C._nn.scaled_dot_product_attention: sdpa_math,
    torch.nn.functional.scaled_dot_product_attention: sdpa_math,
    torch.nn.functional.multi_head_attention_forward: multi_head_attention_math,
    torch.nn.functional.grid_sample: grid_sample_math,
    torch.grid_sampler: grid_sampler_math,
    torch.grid_sampler_2d: grid_sampler_2d_math,
    torch.grid_sampler_3d: grid_sampler_3d_math,
    operator.setitem: masked_setitem,
    torch.index_put: masked_index_put,
}
_SDPA = {torch._C._nn.scaled_dot_product_attention, torch.nn.functional.scaled_dot_product_attention}
#: PyTorch's fused CUDA attention kernels, forward and backward: what SDPA becomes on CUDA when
#: left to AOTAutograd. Kept in PyTorch by design (option ``cuda_torch_attention``).
TORCH_ATTENTION = frozenset(getattr(aten, name).default for name in (
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward",
    "_efficient_attention_forward", "_efficient_attention_backward",
    "_flash_attention_forward", "_flash_attention_backward") if hasattr(aten, name))
#: What ``memory_opt_level=1`` writes attention as instead.
_RECOMPUTING = {sdpa_math: sdpa_recomputed, multi_head_attention_math: multi_head_attention_recomputed}
try:  # defines the torch_nn custom ops (torch versions with F.linear_cross_entropy)
    import torch.nn.modules.linear_cross_entropy  # noqa: F401
except ImportError:
    pass
_TORCH_NN_OPS = getattr(torch.ops, "torch_nn", None)
for _name, _math in (("_linear_cross_entropy_batch_chunked", linear_cross_entropy_chunked_math),
                     ("_linear_cross_entropy_batch_chunked_no_reduction",
                      linear_cross_entropy_chunked_none_math)):
    try:  # registered by torch.nn.functional.linear_cross_entropy (recent torch only)
        _DYNAMO_REWRITES[getattr(_TORCH_NN_OPS, _name).default] = _math
    except (AttributeError, RuntimeError):
        pass


#: Flash attention for CPU, forward and backward: what SDPA becomes on CPU when left to
#: AOTAutograd; kept whole (``cpu_flash``), it runs inside ORT (``lowerings/attention.py``), as
#: torch's kernel (option ``cpu_torch_attention``) or ort_dynamo's (``cpu_attention_kernel``).
FLASH_FOR_CPU = frozenset({aten._scaled_dot_product_flash_attention_for_cpu.default,
                           aten._scaled_dot_product_flash_attention_for_cpu_backward.default})
_SDPA_PARAMETERS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def flash_for_cpu_applies(query, key, value, dropout_p=0.0, attn_mask=None, kind: str = "torch") -> bool:
    """Whether flash attention for CPU runs inside ORT for these operands (values or fake
    tensors): float32 [batch, heads, length, head size] operands of one batch and head count, one
    head size, no dropout, and no mask or a float32 or bool one. ``kind`` "own" (ort_dynamo's
    kernel, csrc/attention.h) also needs a static head size that is a multiple of 16, and takes
    fewer key and value heads than query heads where they divide them (grouped-query attention,
    as torch's flash attention for CPU does)."""
    operands = (query, key, value)
    if not all(isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.dim() == 4 for t in operands):
        return False
    if not (query.shape[0] == key.shape[0] == value.shape[0] and key.shape[1] == value.shape[1]
            and query.shape[-1] == value.shape[-1]):
        return False
    heads, kv_heads, head = query.shape[1], key.shape[1], query.shape[-1]
    if kind == "own":  # key and value heads may serve groups of query heads (grouped-query attention)
        if not (isinstance(heads, int) and isinstance(kv_heads, int) and kv_heads > 0 and heads % kv_heads == 0
                and isinstance(head, int) and head > 0 and head % ATTENTION_HEAD_MULTIPLE == 0):
            return False
    elif heads != kv_heads:
        return False
    if attn_mask is not None and not (isinstance(attn_mask, torch.Tensor) and attn_mask.dim() <= 4
                                      and attn_mask.dtype in (torch.float32, torch.bool)):
        return False
    return isinstance(dropout_p, (int, float)) and dropout_p == 0.0


def _sdpa_for_flash_for_cpu(node: torch.fx.Node, kind: str) -> bool:
    """A Dynamo graph's SDPA call that AOTAutograd will trace to flash attention for CPU that
    ``flash_for_cpu_applies`` takes (its mask needing no gradient; grouped heads for "own" only)."""
    bound = dict(zip(_SDPA_PARAMETERS, node.args), **node.kwargs)

    def value(name, default=None):
        item = bound.get(name, default)
        return item.meta.get("example_value") if isinstance(item, torch.fx.Node) else item

    mask = value("attn_mask")
    if (bound.get("enable_gqa") and kind != "own") or (isinstance(mask, torch.Tensor) and mask.requires_grad):
        return False
    operands = [value(name) for name in ("query", "key", "value")]
    if any(isinstance(t, torch.Tensor) and t.device.type != "cpu" for t in operands):
        return False
    return flash_for_cpu_applies(*operands, value("dropout_p", 0.0), mask, kind)


def lower_graph(gm: torch.fx.GraphModule, fuse: bool = True, recompute_attention: bool = False,
                torch_attention: bool = False, cpu_flash: str = "") -> int:
    """Replace torch-level calls that would leave ORT-less backward kernels, and (``fuse``)
    tanh-GELU written out in Python by one ``F.gelu`` call, a LayerNorm over channels between
    two permutes by one in place, and an STFT's magnitude by real arithmetic. With
    ``recompute_attention`` (``memory_opt_level=1``), attention's backward recomputes its
    probabilities instead of keeping them. With ``torch_attention`` (CUDA), scaled dot-product
    attention is left to AOTAutograd, which gives PyTorch's fused kernels (``TORCH_ATTENTION``);
    with ``cpu_flash`` ("torch" or "own"), the CPU's where ``flash_for_cpu_applies`` takes it
    (``FLASH_FOR_CPU``).
    Returns the count."""
    replaced = 0
    for module in gm.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        changed = (_tanh_gelu_as_one_op(module.graph) + _layer_norm_over_channels_in_place(module.graph)
                   + _stft_magnitudes_in_real_arithmetic(module.graph)) if fuse else 0
        for node in module.graph.nodes:
            kept_whole = node.target in _SDPA and (
                torch_attention or (cpu_flash and _sdpa_for_flash_for_cpu(node, cpu_flash)))
            if node.op == "call_function" and node.target in _DYNAMO_REWRITES and not kept_whole:
                node.target = _DYNAMO_REWRITES[node.target]
                if recompute_attention:
                    node.target = _RECOMPUTING.get(node.target, node.target)
                changed += 1
        if changed:
            module.recompile()
        replaced += changed
    return replaced


_ELEMENTWISE_FUNCTIONS = {operator.mul, operator.add, operator.sub, operator.truediv, operator.pow,
                          torch.mul, torch.add, torch.sub, torch.div, torch.pow, torch.tanh}
_ELEMENTWISE_METHODS = {"mul", "add", "sub", "div", "pow", "tanh", "__mul__", "__add__", "__rmul__",
                        "__radd__", "__sub__", "__truediv__", "__pow__"}
_TANH = {torch.tanh, "tanh"}


def _elementwise(node) -> bool:
    """An elementwise node whose other operands are Python numbers."""
    if not isinstance(node, torch.fx.Node) or node.kwargs:
        return False
    if not ((node.op == "call_function" and node.target in _ELEMENTWISE_FUNCTIONS)
            or (node.op == "call_method" and node.target in _ELEMENTWISE_METHODS)):
        return False
    tensors = [a for a in node.args if isinstance(a, torch.fx.Node)]
    return bool(tensors) and len(tensors) + sum(isinstance(a, (int, float)) for a in node.args) == len(node.args)


def _single_source(out: torch.fx.Node, limit: int = 12):
    """(x, region): the one tensor an elementwise expression ending at ``out`` is computed from,
    and the expression's nodes in graph order; None if it reads more than one tensor."""
    region, leaves, stack = set(), set(), [out]
    while stack:
        node = stack.pop()
        if node in region or node in leaves:
            continue
        if not _elementwise(node):
            leaves.add(node)
            continue
        region.add(node)
        if len(region) > limit:
            return None
        stack.extend(a for a in node.args if isinstance(a, torch.fx.Node))
    if len(leaves) != 1:
        return None
    order = {n: i for i, n in enumerate(out.graph.nodes)}
    return next(iter(leaves)), sorted(region, key=order.__getitem__)


def _evaluate(region, x, probe):
    values = {x: probe}
    for node in region:
        args = [values[a] if isinstance(a, torch.fx.Node) else a for a in node.args]
        values[node] = node.target(*args) if node.op == "call_function" else getattr(args[0], node.target)(*args[1:])
    return values[region[-1]]


def _tanh_gelu_as_one_op(graph: torch.fx.Graph) -> int:
    """GPT-2's ``gelu_new`` (and its kin) is tanh-GELU spelled out: ~8 elementwise ops whose
    intermediates autograd saves for backward. As one ``F.gelu(x, approximate="tanh")`` only x
    is saved, and the forward becomes one fused ORT kernel (FastGelu). An expression qualifies
    if it reads one tensor and computes tanh-GELU on a probe, whatever its spelling."""
    probe = torch.linspace(-8.0, 8.0, 161, dtype=torch.float64)
    want = torch.nn.functional.gelu(probe, approximate="tanh")
    count = 0
    for tanh in [n for n in graph.nodes if _elementwise(n) and n.target in _TANH]:
        out = tanh
        for _ in range(3):  # (1 + tanh(...)) * (0.5 * x): at most a few ops below the tanh
            users = list(out.users)
            if len(users) != 1 or not _elementwise(users[0]):
                break
            out = users[0]
            found = _single_source(out)
            if found is None:
                continue
            x, region = found
            val = _example(x)
            if not (isinstance(val, torch.Tensor) and val.is_floating_point()):
                break
            try:
                got = _evaluate(region, x, probe)
            except Exception:  # an op that does not take a float64 probe: not ours to judge
                break
            if isinstance(got, torch.Tensor) and got.shape == probe.shape and torch.allclose(got, want, rtol=1e-6, atol=1e-7):
                with graph.inserting_after(out):
                    gelu = graph.call_function(torch.nn.functional.gelu, (x,), {"approximate": "tanh"})
                gelu.meta = dict(out.meta)
                out.replace_all_uses_with(gelu)
                for node in reversed(region):
                    if not node.users:
                        graph.erase_node(node)
                count += 1
                break
    return count


@functools.lru_cache(None)
def _onnx_lowered_ops(opset: int, cache_dir: str = "") -> frozenset:
    """Ops torchlib lowers. Asking means building its registry; with an on-disk cache the
    answer is kept there (keyed by package versions), so a warm start never builds it."""
    from . import cache

    key = cache.versions_key("lowered_ops", opset) if cache_dir else None
    names = cache.load_json(cache_dir, key, "lowered_ops") if key else None
    if names is None:
        from torch.onnx._internal.exporter import _decomp

        from .export import onnx_registry  # the registry belongs to the export stage

        names = sorted(op.name() for op in _decomp.get_onnx_implemented_overloads(onnx_registry(opset))
                       if isinstance(op, torch._ops.OpOverload))  # the table is keyed by these
        if key:
            cache.store_json(cache_dir, key, "lowered_ops", names)
    return frozenset(filter(None, map(_overload, names)))


def _overload(qualified: str):
    """``aten::add.Tensor`` -> ``torch.ops.aten.add.Tensor`` (None if this torch lacks it)."""
    namespace, _, rest = qualified.partition("::")
    name, _, overload = rest.partition(".")
    try:
        return getattr(getattr(getattr(torch.ops, namespace), name), overload or "default")
    except AttributeError:
        return None


#: Ops whose torchlib lowering gives wrong results in training; always decomposed instead.
#: torchlib's batch norm forces ``training=False`` (inference statistics); its nll_loss
#: returns a fake ``total_weight`` (element count), which the backward divides by; its CPU
#: flash attention a logsumexp of zeros, which the backward reads.
TORCHLIB_WRONG = frozenset({
    aten._scaled_dot_product_flash_attention_for_cpu.default,  # a logsumexp of zeros
    aten.nll_loss_forward.default,
    aten.nll_loss2d_forward.default,
    aten._native_batch_norm_legit_functional.default,
    aten._native_batch_norm_legit.default,
    aten._native_batch_norm_legit.no_stats,
    aten.native_batch_norm.default,
})


#: The same for CUDA's attention kernels (their logsumexp, zeros in torchlib's lowering, is what
#: their backward reads), which have no decomposition here (none could be tested without a
#: GPU): they run in PyTorch, reported. ``F.scaled_dot_product_attention`` itself never
#: reaches them (``lower_graph`` writes it out); callers Dynamo keeps whole can.
TORCHLIB_FAKE_LOGSUMEXP = frozenset(getattr(aten, name).default for name in (
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention") if hasattr(aten, name))


_NEVER_DECOMPOSE = {aten.lift, aten.lift_fresh, aten.sym_numel, aten.is_same_size}


def _composite_kernels() -> set:
    """Ops the tracer should decompose with their own CompositeImplicitAutograd kernel, not with
    the Python ref of torch's table: what ``core_aten_decompositions()`` maps them to (functional
    ops with a C++ composite kernel, outside its post-autograd list; collecting that table itself
    costs 0.08 s). Some refs cannot be traced: ``aten.item``'s calls ``prims.item`` on a fake
    tensor. Without an entry the tracer runs the kernel (``OpOverload.decompose``)."""
    post_autograd = _core_aten_decompositions_post_autograd()
    python_kernel = torch._C.DispatchKey.CompositeImplicitAutograd
    return {op for op in _torch_decompositions
            if isinstance(op, torch._ops.OpOverload) and _is_preservable_cia_op(op) and op not in post_autograd
            and op not in PRESERVED_ATEN_CIA_OPS and python_kernel not in op.py_kernels}


@functools.lru_cache(None)
def decomposition_table(opset: int = 18, cache_dir: str = "", pointwise: bool = False,
                        cpu_flash: str = "", pytorch_draws: bool = False,
                        own_products: bool = False) -> dict:
    """Decompositions for AOTAutograd: only ops that torchlib cannot lower (correctly).

    torch's registered decompositions, functional ops only (in-place/out variants are gone
    after functionalization), never the tensor-lifting ones, which break fake tracing, and
    not those ``core_aten_decompositions()`` leaves to their composite kernel
    (``_composite_kernels``): its own table, the same otherwise, takes 0.08 s of every
    process's first step to collect. ``pointwise``: the graph's elementwise chains
    will become generated kernels, which changes the cheaper way to write a few ops.
    ``cpu_flash`` ("torch" or "own"): flash attention for CPU stays whole where ORT runs it
    (``flash_for_cpu_applies``). ``pytorch_draws``: random draws will run in PyTorch
    (``random_draws_in_pytorch``), so those torch writes with other draws (``exponential`` from
    a uniform, ...) stay whole, and PyTorch's kernel draws eager's values. ``own_products``: the
    CPU kernels include products of their own, which take a few ops whole (a convolution's
    weight gradient)."""
    lowered = _onnx_lowered_ops(opset, cache_dir) - TORCHLIB_WRONG
    composite = _composite_kernels()
    table = {op: fn for op, fn in _torch_decompositions.items()
             if isinstance(op, torch._ops.OpOverload) and op not in lowered
             and op.overloadpacket not in _NEVER_DECOMPOSE
             and not op._schema.name.endswith("_") and "out" not in op._overloadname
             and op not in composite}
    missing = [op for op in TORCHLIB_WRONG if op not in table]
    if missing:
        raise RuntimeError(f"no decomposition for {missing}: their torchlib lowering is wrong")
    table.update(own_decompositions())
    if pointwise:
        table.update(pointwise_decompositions())
    if own_products:
        table.update(product_decompositions())
    if cpu_flash:
        table.update(_flash_for_cpu_kept(table, cpu_flash))
    if pytorch_draws:
        for op in _DRAWS_LIKE | _DRAWS_FROM_SIZES | _DRAWS_FROM_VALUES:
            table.pop(op, None)
    return table


def _flash_for_cpu_kept(table: dict, kind: str) -> dict:
    """Flash attention for CPU's decompositions, declining (NotImplemented: the op stays) where
    ORT runs it (``kind``: torch's kernel or ort_dynamo's)."""
    forward = table[aten._scaled_dot_product_flash_attention_for_cpu.default]
    backward = table[aten._scaled_dot_product_flash_attention_for_cpu_backward.default]

    def kept_forward(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
        if flash_for_cpu_applies(query, key, value, dropout_p, attn_mask, kind):
            return NotImplemented
        return forward(query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)

    def kept_backward(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *, attn_mask=None,
                      scale=None):
        if flash_for_cpu_applies(query, key, value, dropout_p, attn_mask, kind):
            return NotImplemented
        return backward(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, attn_mask=attn_mask,
                        scale=scale)

    return {aten._scaled_dot_product_flash_attention_for_cpu.default: kept_forward,
            aten._scaled_dot_product_flash_attention_for_cpu_backward.default: kept_backward}


#: Ops torch decomposes in Python above autograd while tracing (``py_impl`` kernels): nearest
#: and linear upsampling become index gathers whose backward scatters with an int64 index per
#: element.
_UPSAMPLING = tuple(getattr(getattr(aten, name), overload)
                    for name in ("upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d",
                                 "upsample_linear1d", "upsample_bilinear2d", "upsample_trilinear3d")
                    for overload in ("vec", "default"))
_ABOVE_AUTOGRAD = (torch._C.DispatchKey.Autograd, torch._C.DispatchKey.CompositeImplicitAutograd)
_upsampling_lock = threading.RLock()


def _upsampling_vec(default):
    """An upsampling op's ``.vec`` as its ``.default``, the output size computed as torch's
    Python kernel computes it (symbolic sizes allowed), the scales passed on as ATen does."""
    from torch._decomp.decompositions import upsample_compute_output_size

    def vec(x, output_size, *arguments):
        scale_factors = arguments[-1]  # after align_corners, for the linear modes
        size = upsample_compute_output_size(x.size(), output_size, scale_factors)
        scales = list(scale_factors) if scale_factors else [None] * len(size)
        return default(x, size, *arguments[:-1], *scales)

    return vec


@contextlib.contextmanager
def whole_upsampling():
    """While AOTAutograd traces: nearest and linear upsampling reach the trace as the ATen op,
    with ATen's backward op, so the decomposition table chooses (ONNX Resize, and a backward of
    reshaped sums and shifts, where the scale is a whole number; torch's own gather and an
    index_add otherwise, ``decompositions``).
    torch's Python kernels for those dispatch keys are set aside and put back after; eager
    never runs them (only the tracer's Python dispatcher does), and ATen's C++ kernels compute
    the same. A ``.vec`` overload (sizes or scales) gets a kernel that calls its ``.default``
    op instead: ATen's C++ one needs the output size in numbers, and under ``dynamic=True``
    it is symbolic (SegFormer's decoder upsamples to a size read off a tensor)."""
    with _upsampling_lock:
        saved = {}
        try:
            for op in _UPSAMPLING:
                for key in _ABOVE_AUTOGRAD:
                    if key in op.py_kernels:
                        saved[op, key] = op.py_kernels.pop(key)
                        if op._overloadname == "vec":
                            op.py_kernels[key] = _upsampling_vec(op.overloadpacket.default)
                op._dispatch_cache.clear()
            yield
        finally:
            for (op, key), kernel in saved.items():
                op.py_kernels[key] = kernel
            for op in _UPSAMPLING:
                op._dispatch_cache.clear()


#: Fewer rows than this stay a sum of Wheres or Pads: the pointwise kernels fuse a few (an
#: interleaved RoPE's pair, a q/k/v split's three), and a Concat of many short runs is slower.
_MIN_STACKED_ROWS = 4


def stacked_row_gradients(gm: torch.fx.GraphModule) -> int:
    """After AOTAutograd: the gradient of a tensor read row by row (``x[:, t]`` for every t: a
    loop over time steps, an unrolled ``nn.LSTM``) is a sum of one ``select_backward`` per row,
    each a full-size Where or Pad of zeros: a pass over the whole tensor per row, quadratic in
    the rows. A sum that holds every row once is those rows stacked: one copy. Likewise a sum
    of many matrix products (a weight's gradient over the steps) is one product, and a sum of
    many row sums (a bias's) one row sum. Returns how many sums were replaced."""
    graph, replaced = gm.graph, 0
    for root in list(graph.nodes):
        if not _is_add(root) or (len(root.users) == 1 and _is_add(next(iter(root.users)))):
            continue  # not the top of a sum
        leaves = _summands(root)
        if _join_products(graph, root, leaves) or _join_row_sums(graph, root, leaves) \
                or _stack_rows(graph, root, leaves):
            replaced += 1
    if replaced:
        graph.eliminate_dead_code()
        gm.recompile()
    return replaced


def unit_sums_removed(gm: torch.fx.GraphModule) -> int:
    """After AOTAutograd: a ``sum`` over dims that are all of size 1 (autograd's sum back to a
    broadcast operand's shape, where the dim was 1 already: an unrolled LSTM's gates, 128 per
    step at 64 steps) changes nothing but the shape; ORT runs each as a ReduceSum pass (50 us
    at [1, 16, 1024]). Now the tensor itself, or it squeezed where the dims go. Returns how
    many were removed."""
    removed = 0
    for node in list(gm.graph.nodes):
        if not _call(node, aten.sum.dim_IntList) or node.kwargs or len(node.args) < 2:
            continue
        x, out = node.args[0], node.meta.get("val")
        value = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
        if not isinstance(value, torch.Tensor) or not isinstance(out, torch.Tensor) or value.dtype != out.dtype \
                or not node.args[1] or value.dim() == 0:
            continue
        dims = [d % value.dim() for d in node.args[1]]
        if not all(isinstance(value.shape[d], int) and value.shape[d] == 1 for d in dims):
            continue  # a symbolic size known to be 1: squeezing it is squeezes_as_traced's trouble
        keep = len(node.args) > 2 and node.args[2]
        with gm.graph.inserting_before(node):
            same = x if keep else _fx_call(gm.graph, aten.squeeze.dims, x, dims)
        node.replace_all_uses_with(same)
        removed += 1
    if removed:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return removed


def _join_products(graph: torch.fx.Graph, root: torch.fx.Node, leaves: list) -> bool:
    """A weight's gradient over the steps: sum_t a_t @ b_t is one product of the steps side by
    side, [a_0 ... a_T] @ [b_0; ...; b_T]: one GEMM with a long inner dimension instead of T
    thin ones and a T-way sum (64 steps of an LSTM: 20 ms). Only for thin products: the
    operands are held to the end for the Concats, which costs less than the sum only where
    each product writes more than it reads (not a weight shared by a model's layers, whose
    products read whole activations)."""
    by_parity: dict = {}
    for leaf in leaves:
        product = _product(leaf)
        if product is not None:
            a, b, transposed = product
            by_parity.setdefault(transposed, []).append((leaf, a, b))
    if not by_parity:
        return False
    transposed, products = max(by_parity.items(), key=lambda item: len(item[1]))
    if len(products) < _MIN_STACKED_ROWS or not all(_thin(a, b) for _, a, b in products) \
            or not _same_shape(root, [leaf for leaf, _, _ in products]):
        return False

    def joined():
        left = _fx_call(graph, aten.cat.default, [a for _, a, _ in products], 1)
        right = _fx_call(graph, aten.cat.default, [b for _, _, b in products], 0)
        total = _fx_call(graph, aten.mm.default, left, right)
        return _fx_call(graph, aten.t.default, total) if transposed else total

    _replace_sum(graph, root, leaves, [leaf for leaf, _, _ in products], joined)
    return True


def _join_row_sums(graph: torch.fx.Graph, root: torch.fx.Node, leaves: list) -> bool:
    """A bias's gradient over the steps: sum_t (g_t summed over its rows) is one sum over the
    steps' rows stacked, [g_0; ...; g_T], instead of a small reduction per step and a T-way sum
    (an unrolled LSTM's 64 steps: 64 ReduceSums of [16, 1024] in ORT, 43 us each). Terms: a
    ``sum`` of a 2-D g over dim 0, viewed or not, all alike."""
    sums = []
    for leaf in leaves:
        summed, view = leaf, None
        if _call(leaf, aten.view.default) and len(leaf.users) == 1:
            summed, view = leaf.args[0], leaf.args[1]
        if not _call(summed, aten.sum.dim_IntList) or len(summed.users) != 1 or summed.kwargs:
            continue
        g, dims, keep = summed.args[0], summed.args[1], summed.args[2] if len(summed.args) > 2 else False
        value = g.meta.get("val") if isinstance(g, torch.fx.Node) else None
        if list(dims) in ([0], [-2]) and isinstance(value, torch.Tensor) and value.dim() == 2:
            sums.append((leaf, g, bool(keep), view))
    if len(sums) < _MIN_STACKED_ROWS or len({(keep, repr(view)) for _, _, keep, view in sums}) != 1 \
            or not _same_shape(root, [leaf for leaf, *_ in sums]) \
            or not _same_shape(sums[0][1], [g for _, g, _, _ in sums]):
        return False
    _, _, keep, view = sums[0]

    def joined():
        total = _fx_call(graph, aten.sum.dim_IntList, _fx_call(graph, aten.cat.default, [g for _, g, _, _ in sums], 0),
                         [0], keep)
        return _fx_call(graph, aten.view.default, total, view) if view is not None else total

    _replace_sum(graph, root, leaves, [leaf for leaf, *_ in sums], joined)
    return True


def _stack_rows(graph: torch.fx.Graph, root: torch.fx.Node, leaves: list) -> bool:
    """The terms that are each one row of a dim, every row once, as those rows stacked."""
    groups: dict = {}
    for leaf in leaves:
        row = _selected_row(leaf)
        if row is not None:
            groups.setdefault(row[1:3], []).append((row, leaf))
    for (dim, size), rows in groups.items():
        grads = {index: grad for (grad, _, _, index), _ in rows}
        if size < _MIN_STACKED_ROWS or len(grads) != len(rows) or set(grads) != set(range(size)) \
                or not _same_shape(root, [leaf for _, leaf in rows]) \
                or not _known(root.meta["val"].shape[dim] == size):
            continue
        _replace_sum(graph, root, leaves, [leaf for _, leaf in rows],
                     lambda: _fx_call(graph, aten.stack.default, [grads[i] for i in range(size)], dim))
        return True  # the root is gone: one group per sum
    return False


def _replace_sum(graph: torch.fx.Graph, root: torch.fx.Node, leaves: list, joined: list, build) -> None:
    """The sum at ``root`` becomes ``build()``, which stands for the ``joined`` terms, plus the rest."""
    rest = [leaf for leaf in leaves if all(leaf is not j for j in joined)]
    with graph.inserting_before(root):
        total = build()
        for other in rest:
            total = _fx_call(graph, aten.add.Tensor, total, other)
    root.replace_all_uses_with(total)


def _is_add(node) -> bool:
    return node.op == "call_function" and node.target is aten.add.Tensor and len(node.args) == 2 \
        and not node.kwargs and all(isinstance(a, torch.fx.Node) for a in node.args)


def _summands(root: torch.fx.Node) -> list:
    """The terms of a tree of adds whose inner adds feed only the next."""
    terms, stack = [], [root]
    while stack:
        node = stack.pop()
        for arg in reversed(node.args):
            if _is_add(arg) and len(arg.users) == 1:
                stack.append(arg)
            else:
                terms.append(arg)
    return terms


def _same_shape(root: torch.fx.Node, terms: list) -> bool:
    """Whether the sum and these terms have one shape and dtype (a sum may broadcast): equal
    sizes, symbolic ones too (``dynamic=True``'s batch) where they are equal without a guard."""
    values = [n.meta.get("val") for n in (root, *terms)]
    first = values[0]
    return all(isinstance(v, torch.Tensor) and v.dim() == first.dim() and v.dtype == first.dtype
               and all(_known(a == b) for a, b in zip(v.shape, first.shape)) for v in values)


def _product(node):
    """(a, b, transposed) when ``node`` is ``a @ b``, transposed an odd number of times or not."""
    transposed = False
    while _call(node, aten.t.default) and len(node.users) == 1:
        node, transposed = node.args[0], not transposed
    if not _call(node, aten.mm.default) or len(node.users) != 1:
        return None
    return node.args[0], node.args[1], transposed


def _thin(a: torch.fx.Node, b: torch.fx.Node) -> bool:
    """Whether ``a @ b`` writes more elements than its operands hold (a small inner dimension)."""
    left, right = a.meta.get("val"), b.meta.get("val")
    if not isinstance(left, torch.Tensor) or not isinstance(right, torch.Tensor) or left.dim() != 2 \
            or right.dim() != 2:
        return False
    (m, k), n = (size_hint(d) for d in left.shape), size_hint(right.shape[1])  # a choice of speed: no guard
    return m * n > k * (m + n)


def _selected_row(node):
    """(grad, dim, size, index) when ``node`` is ``select_backward``'s full-size tensor as
    decompositions writes it: a Where of one row of an arange, or a Pad of zeros around
    ``grad.unsqueeze(dim)``."""
    value = node.meta.get("val")
    if node.op != "call_function" or not isinstance(value, torch.Tensor):
        return None
    if node.target is aten.clone.default:
        return _selected_row(node.args[0])  # x[:, t] under dynamic=True: the full slice's backward
    rank = value.dim()
    if node.target is aten.where.self:
        cond, picked, other = node.args
        if not (_call(cond, aten.eq.Scalar) and _call(picked, aten.unsqueeze.default)
                and _call(other, aten.zeros.default) and list(other.args[0]) == []):
            return None
        rows, index = cond.args
        if not (_call(rows, aten.view.default) and _call(rows.args[0], aten.arange.default)
                and len(rows.args[0].args) == 1 and isinstance(rows.args[0].args[0], int)):
            return None
        size, shape = rows.args[0].args[0], list(rows.args[1])
        dim = picked.args[1] % rank
        if len(shape) != rank or shape != [size if d == dim else 1 for d in range(rank)] or not isinstance(index, int):
            return None
        return picked.args[0], dim, size, index
    if node.target is aten.constant_pad_nd.default:
        picked, pads = node.args[0], list(node.args[1])
        if (node.args[2] if len(node.args) > 2 else 0) != 0 or not _call(picked, aten.unsqueeze.default):
            return None
        dim = picked.args[1] % rank
        pairs = {rank - 1 - j: (pads[2 * j], pads[2 * j + 1]) for j in range(len(pads) // 2)}
        before, after = pairs.get(dim, (0, 0))
        if any(pair != (0, 0) for d, pair in pairs.items() if d != dim) or not isinstance(before, int) \
                or not isinstance(after, int):
            return None
        return picked.args[0], dim, before + 1 + after, before
    return None


def _call(node, target) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is target


def _fx_call(graph: torch.fx.Graph, target, *args) -> torch.fx.Node:
    """A new call node with its fake value, computed as the tracer would (sizes' arithmetic,
    with no tensor among the values, needs no fake mode)."""
    node = graph.call_function(target, args)
    values = torch.fx.node.map_arg(args, lambda n: n.meta["val"])
    fake = next((v for v in torch.utils._pytree.tree_leaves(values) if isinstance(v, torch.Tensor)), None)
    with fake.fake_mode if fake is not None else contextlib.nullcontext():
        node.meta["val"] = target(*values)
    return node


#: What nn.LSTM, nn.GRU and nn.RNN call; Dynamo captures those modules only with
#: ``torch._dynamo.config.allow_rnn`` (otherwise they are a graph break the report lists).
_RNN_OPS = (torch.lstm, torch.gru, torch.rnn_tanh, torch.rnn_relu)
_rnn_lock = threading.Lock()


@contextlib.contextmanager
def trainable_rnns(gm: torch.fx.GraphModule):
    """While AOTAutograd traces a graph that calls an RNN: torch writes an LSTM layer whose
    input needs no gradient (the first layer, when the batch is data) as oneDNN's
    inference-only layer op, even when its weights train, and that op's backward finds no
    workspace: training fails whatever the backend (aot_eager too). With oneDNN off while
    tracing, every RNN is unrolled into its cells' products and elementwise ops, which
    autograd differentiates and ORT runs. oneDNN's switch is process-wide, so it is only
    touched for graphs that have an RNN, and put back after."""
    graphs = [m.graph for m in gm.modules() if isinstance(m, torch.fx.GraphModule)]
    if not any(n.op == "call_function" and n.target in _RNN_OPS for g in graphs for n in g.nodes):
        yield
        return
    with _rnn_lock:
        enabled = torch._C._get_mkldnn_enabled()
        torch._C._set_mkldnn_enabled(False)
        try:
            yield
        finally:
            torch._C._set_mkldnn_enabled(enabled)


def channels_first_layer_norm(x, weight=None, bias=None, eps: float = 1e-5):
    """LayerNorm over dim 1, in x's own layout: reductions over the channels and elementwise
    ops, no transposes forward or backward."""
    mean = x.mean(1, keepdim=True)
    centered = x - mean
    y = centered * torch.rsqrt((centered * centered).mean(1, keepdim=True) + eps)
    shape = [-1] + [1] * (x.dim() - 2)
    if weight is not None:
        y = y * weight.reshape(shape)
    if bias is not None:
        y = y + bias.reshape(shape)
    return y


_LAYER_NORMS = {torch.nn.functional.layer_norm, torch.layer_norm}
_PERMUTES = {"permute", torch.permute}


def _permute_dims(node) -> list | None:
    """The dims of a ``permute`` node (method or function, dims spread or in a sequence)."""
    if not isinstance(node, torch.fx.Node) or node.kwargs or node.target not in _PERMUTES \
            or node.op not in ("call_method", "call_function") or len(node.args) < 2:
        return None
    dims = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], (tuple, list)) else node.args[1:]
    return list(dims) if all(isinstance(d, int) for d in dims) else None


def _example(node):
    """What a Dynamo graph's node computes, as its fake value (None for a constant argument)."""
    return node.meta.get("example_value", node.meta.get("val")) if isinstance(node, torch.fx.Node) else None


def _float32_cpu(node) -> bool:
    val = _example(node)
    return isinstance(val, torch.Tensor) and val.dtype == torch.float32 and val.device.type == "cpu"


def _layer_norm_over_channels_in_place(graph: torch.fx.Graph) -> int:
    """``F.layer_norm(x.permute(0, 2, .., 1), (C,)).permute(0, n-1, 1, ..)``, timm's
    LayerNorm2d: a LayerNorm over the channels of an NCHW tensor. ORT transposes twice forward
    and its kernels read the gradient through transposes backward; computed in x's layout,
    the channels are a reduction over dim 1 instead (``channels_first_layer_norm``). CPU
    float32 only: eager's own kernel runs LayerNorm in float32, these ops in x's dtype."""
    count = 0
    for norm in [n for n in graph.nodes if n.op == "call_function" and n.target in _LAYER_NORMS]:
        names = ("input", "normalized_shape", "weight", "bias", "eps")
        args = dict(zip(names, norm.args), **norm.kwargs)
        permute, shape = args.get("input"), args.get("normalized_shape")
        dims = _permute_dims(permute)
        users = list(norm.users)
        if dims is None or len(dims) < 3 or len(users) != 1 or set(args) - set(names):
            continue
        rank = len(dims)
        back = _permute_dims(users[0])
        x = permute.args[0]
        val = _example(x)
        if dims != [0, *range(2, rank), 1] or back != [0, rank - 1, *range(1, rank - 1)] \
                or not _float32_cpu(x) or not _float32_cpu(norm) or val.dim() != rank \
                or list(shape if isinstance(shape, (tuple, list)) else [shape]) != [val.shape[1]] \
                or not all(p is None or _float32_cpu(p) for p in (args.get("weight"), args.get("bias"))) \
                or not isinstance(args.get("eps", 1e-5), float):
            continue
        with graph.inserting_after(users[0]):
            in_place = graph.call_function(channels_first_layer_norm,
                                           (x, args.get("weight"), args.get("bias"), args.get("eps", 1e-5)))
        in_place.meta = dict(users[0].meta)
        users[0].replace_all_uses_with(in_place)
        graph.erase_node(users[0])
        graph.erase_node(norm)
        if not permute.users:
            graph.erase_node(permute)
        count += 1
    return count


def stft_magnitude(x, n_fft: int, hop_length=None, win_length=None, window=None, center: bool = True,
                   pad_mode: str = "reflect", normalized: bool = False, onesided=None):
    """``torch.stft(x, ..., return_complex=True).abs()`` in real arithmetic: the signal's
    frames (``Tensor.unfold``) times the DFT's cosine and sine bases. A magnitude of zero has
    the gradient zero, as torch's complex ``abs`` gives it."""
    hop = hop_length or n_fft // 4
    win_length = win_length or n_fft
    signal = x if x.dim() == 2 else x.unsqueeze(0)
    if center:
        signal = torch.nn.functional.pad(signal.unsqueeze(1), (n_fft // 2, n_fft // 2), mode=pad_mode).squeeze(1)
    frames = signal.unfold(-1, n_fft, hop)  # (batch, frames, n_fft)
    if window is None:
        window = torch.ones(win_length, dtype=x.dtype, device=x.device)
    if win_length < n_fft:  # centred in n_fft, as torch.stft pads it
        left = (n_fft - win_length) // 2
        window = torch.nn.functional.pad(window, (left, n_fft - win_length - left))
    frames = frames * window
    bins = n_fft // 2 + 1 if onesided is None or onesided else n_fft
    n = torch.arange(n_fft, dtype=torch.float64, device=x.device)
    k = torch.arange(bins, dtype=torch.float64, device=x.device)
    angle = (n[:, None] * k[None, :]).remainder(n_fft) * (2 * math.pi / n_fft)  # exact phase first
    basis = torch.cat([torch.cos(angle), torch.sin(angle)], 1).to(x.dtype)  # one product for both parts
    real, imag = (frames @ basis).split(bins, -1)
    power = real * real + imag * imag
    nonzero = power > 0
    magnitude = torch.where(nonzero, torch.sqrt(torch.where(nonzero, power, 1.0)), 0.0)
    if normalized:
        magnitude = magnitude * n_fft ** -0.5
    magnitude = magnitude.transpose(-1, -2)  # (batch, bins, frames)
    return magnitude if x.dim() == 2 else magnitude.squeeze(0)


_STFT_PARAMETERS = ("input", "n_fft", "hop_length", "win_length", "window", "center", "pad_mode", "normalized",
                    "onesided", "return_complex")


def _stft_magnitudes_in_real_arithmetic(graph: torch.fx.Graph) -> int:
    """``torch.stft(..., return_complex=True)`` whose every use is ``.abs()`` (a spectrogram's
    magnitude or power, torchaudio's Spectrogram) -> ``stft_magnitude``. ORT has no complex
    tensors, so the STFT and its abs would stay in PyTorch. Float32 CPU signals only."""
    count = 0
    for node in [n for n in graph.nodes if n.op == "call_function" and n.target in (torch.stft, torch.functional.stft)]:
        if len(node.args) > len(_STFT_PARAMETERS) or set(node.kwargs) - set(_STFT_PARAMETERS):
            continue
        args = {**dict(zip(_STFT_PARAMETERS, node.args)), **node.kwargs}
        users = list(node.users)
        val = _example(args["input"])
        scalars = [args.get(name) for name in ("n_fft", "hop_length", "win_length")]
        if args.get("return_complex") is not True or not users or not _float32_cpu(args["input"]) \
                or val.dim() not in (1, 2) or not all(s is None or isinstance(s, int) for s in scalars) \
                or not isinstance(args.get("center", True), bool) or not isinstance(args.get("pad_mode", "reflect"), str) \
                or args.get("normalized", False) not in (True, False) or args.get("onesided") not in (None, True, False) \
                or not (args.get("window") is None or _float32_cpu(args["window"])) \
                or not all((u.op == "call_method" and u.target == "abs" or u.op == "call_function" and u.target is torch.abs)
                           and len(u.args) == 1 and not u.kwargs for u in users):
            continue
        with graph.inserting_after(node):  # one magnitude, however many uses take the abs
            magnitude = graph.call_function(stft_magnitude, (args["input"],), {
                name: args.get(name) for name in _STFT_PARAMETERS[1:-1] if name in args})
        magnitude.meta = dict(users[0].meta)
        for use in users:
            use.replace_all_uses_with(magnitude)
            graph.erase_node(use)
        graph.erase_node(node)
        count += 1
    return count


#: Meta key of a node that runs in PyTorch by design (``partition`` leaves it there, not a
#: fallback); its value is the reason the report gives, "" for a helper it does not list.
IN_PYTORCH = "ort_dynamo_in_pytorch"
_RANDOM_DRAW = "a random draw, from PyTorch's generator (option torch_random)"
#: Draws whose tensor argument gives only the shape and dtype (the functional forms of
#: ``uniform_``, ``exponential_``, ... and the ``*_like`` ones).
_DRAWS_LIKE = frozenset({aten.rand_like.default, aten.randn_like.default, aten.randint_like.default,
                         aten.randint_like.low_dtype, aten.bernoulli.p, aten.uniform.default, aten.exponential.default,
                         aten.cauchy.default, aten.geometric.default, aten.log_normal.default,
                         aten.normal_functional.default})
#: Draws from shapes and numbers alone.
_DRAWS_FROM_SIZES = frozenset({aten.rand.default, aten.randn.default, aten.randint.default, aten.randint.low,
                               aten.randperm.default, aten.normal.float_float})
#: Draws that read their tensor's values: they stay where they are, in PyTorch.
_DRAWS_FROM_VALUES = frozenset({aten.bernoulli.default, aten.bernoulli.Tensor, aten.normal.Tensor_float,
                                aten.normal.float_Tensor, aten.normal.Tensor_Tensor, aten.multinomial.default,
                                aten.poisson.default, aten._standard_gamma.default,
                                aten.rrelu_with_noise_functional.default})


#: Activation checkpointing's random ops: forward saves the generator's state, backward
#: replays the op from it. Only PyTorch can; their values were never ORT's to draw.
_RNG_STATE_OPS = frozenset(filter(None, (getattr(torch.ops.higher_order, name, None)
                                         for name in ("run_and_save_rng_state", "run_with_rng_state"))))
_REPLAYED_DRAW = "a random op activation checkpointing replays from PyTorch's generator state"


def random_draws_in_pytorch(gm: torch.fx.GraphModule, all_draws: bool = True) -> int:
    """After AOTAutograd: activation checkpointing's random ops (``run_and_save_rng_state`` and
    ``run_with_rng_state``) are marked to run in PyTorch, as they must, so that the report lists
    them. With ``all_draws`` (a forward graph on CPU): every random draw runs in PyTorch, with
    its generator, so ``torch.manual_seed`` and ``get_rng_state``/``set_rng_state`` reproduce
    it; dropout's masks are eager's own, bit for bit. ORT's random ops draw from a generator of
    their own that nothing in PyTorch seeds.

    A draw whose tensor argument only gives a shape gets an ``empty`` of that shape instead,
    made from the graph's inputs: it depends on nothing ORT computes, so it runs before the
    ORT partition and does not split it. ``native_dropout`` draws its mask as eager's CPU
    kernel does (``bernoulli_(1 - p)``), and the scaling stays on ORT. Returns the number of
    draws moved to PyTorch."""
    graph, drawn = gm.graph, 0
    sizes = _InputSizes(graph)
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target in _RNG_STATE_OPS:
            node.meta[IN_PYTORCH] = _REPLAYED_DRAW
        elif not all_draws:
            continue
        elif node.target is aten.native_dropout.default:
            drawn += _dropout_with_pytorchs_mask(graph, node, sizes)
        elif node.target in _DRAWS_LIKE and isinstance(node.args[0], torch.fx.Node):
            _draw_into_an_empty(graph, node, sizes)
            drawn += 1
        elif node.target in _DRAWS_FROM_SIZES or node.target in _DRAWS_FROM_VALUES:
            node.meta[IN_PYTORCH] = _RANDOM_DRAW
            drawn += 1
    if drawn:
        graph.eliminate_dead_code()
        gm.recompile()
    return drawn


def _draw_into_an_empty(graph: torch.fx.Graph, node: torch.fx.Node, sizes: "_InputSizes") -> None:
    """A draw whose tensor argument only gives the shape (``rand_like``, ``uniform``, ...) takes
    an ``empty`` made from the graph's inputs instead, and runs in PyTorch."""
    with graph.inserting_before(node):
        like, order = _empty_like(graph, node.args[0], node, sizes)
    node.update_arg(0, like)
    node.meta[IN_PYTORCH] = _RANDOM_DRAW
    if order is None:
        return
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta["val"])
    with like.meta["val"].fake_mode:  # the draw has the empty's shape now: its value anew
        node.meta["val"] = node.target(*args, **kwargs)
    users = list(node.users)
    with graph.inserting_after(node):
        view = _in_logical_order(graph, node, order)
    for user in users:
        user.replace_input_with(node, view)


def _dropout_with_pytorchs_mask(graph: torch.fx.Graph, node: torch.fx.Node, sizes: "_InputSizes") -> int:
    """``native_dropout(x, p, train)`` -> mask = ``bernoulli(empty(x.shape, bool), 1 - p)`` in
    PyTorch, ``x * mask * scale`` on ORT: eager's CPU kernel, which multiplies as written."""
    x, p = node.args[0], node.args[1]
    train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train")
    if train is False or not isinstance(x, torch.fx.Node) or not isinstance(p, (int, float)):
        return 0  # a symbolic p stays ORT's draw
    users = list(node.users)
    if any(not _call(user, operator.getitem) for user in users):
        return 0
    scale = 0.0 if p == 1.0 else 1.0 / (1.0 - p)
    with graph.inserting_before(node):
        empty, order = _empty_like(graph, x, node, sizes, dtype=torch.bool)
        drawn = _fx_call(graph, aten.bernoulli.p, empty, 1.0 - p)
        drawn.meta[IN_PYTORCH] = _RANDOM_DRAW
        mask = _in_logical_order(graph, drawn, order)
        out = _fx_call(graph, aten.mul.Tensor, _fx_call(graph, aten.mul.Tensor, x, mask), scale)
    for new in (empty, drawn, mask, out, out.args[0]):
        new.meta.setdefault("stack_trace", node.meta.get("stack_trace"))
    for user in users:
        user.replace_all_uses_with(out if user.args[1] == 0 else mask)
        graph.erase_node(user)
    graph.erase_node(node)
    return 1


def _empty_like(graph: torch.fx.Graph, like: torch.fx.Node, draw: torch.fx.Node, sizes: "_InputSizes",
                dtype=None) -> tuple[torch.fx.Node, list[int] | None]:
    """``empty`` of ``like``'s shape and dtype (or ``dtype``), sized from the graph's inputs
    (``_InputSizes``); by ``like``'s own size where they do not have one (then the draw waits
    for ``like``). Eager draws into ``empty_like(like)``, which keeps ``like``'s memory order,
    and fills it in memory order: for a transposed or channels-last ``like`` the ``empty`` is
    made row-major with the axes in that order, and the second value is the order
    (``_memory_order``), which ``_in_logical_order`` undoes after the draw; else None."""
    value = like.meta["val"]
    shape = [sizes.of(size) for size in value.shape]
    shape = [_fx_call(graph, aten.sym_size.int, like, axis) if found is None else found
             for axis, found in enumerate(shape)]
    order = _memory_order(value)
    if order is not None:
        shape = [shape[axis] for axis in order]
    empty = graph.call_function(aten.empty.memory_format, (shape,),
                                {"dtype": dtype or value.dtype, "device": value.device, "pin_memory": False})
    with value.fake_mode:
        empty.meta["val"] = torch.empty([value.shape[axis] for axis in order or range(value.dim())],
                                        dtype=dtype or value.dtype, device=value.device)
    empty.meta[IN_PYTORCH] = ""
    empty.meta["stack_trace"] = draw.meta.get("stack_trace")
    return empty, order


def _in_logical_order(graph: torch.fx.Graph, drawn: torch.fx.Node, order: list[int] | None) -> torch.fx.Node:
    """``drawn``, drawn with its axes in memory ``order`` (``_empty_like``), as a view with
    them in their own order again: eager's tensor, the same numbers in the same memory."""
    if order is None:
        return drawn
    view = _fx_call(graph, aten.permute.default, drawn, [order.index(axis) for axis in range(len(order))])
    view.meta["stack_trace"] = drawn.meta.get("stack_trace")
    return view


def _memory_order(value: torch.Tensor) -> list[int] | None:
    """``value``'s axes from outermost to innermost in memory, as ``empty_like`` orders a new
    tensor's (torch's reference implementation); None where that is row-major."""
    from torch._prims_common import compute_elementwise_output_logical_to_physical_perm

    order = compute_elementwise_output_logical_to_physical_perm(value)
    order = list(order[0] if isinstance(order, tuple) else order)  # (perm, ambiguous) since torch 2.12
    return None if order == list(range(value.dim())) else order


def _size_arithmetic() -> dict:
    """The sympy functions of shape arithmetic (a strided window's count, (s - 1) // 4 + 1), as
    the Python operation that computes each on SymInts."""
    from torch.utils._sympy import functions as sizes

    return {sizes.FloorDiv: operator.floordiv, sizes.CleanDiv: operator.floordiv, sizes.PythonMod: operator.mod,
            sizes.Mod: operator.mod, sizes.PowByNatural: operator.pow, sizes.Max: torch.sym_max,
            sizes.Min: torch.sym_min}


_SIZE_ARITHMETIC = _size_arithmetic()


class _InputSizes:
    """Sizes computed from a graph's inputs: placeholders that are a size's symbols, or sizes
    of placeholder tensors that have them, added and multiplied as its expression says. Each
    expression is looked up, and its nodes made, once (where first needed: later needs come
    after it in the graph)."""

    def __init__(self, graph: torch.fx.Graph) -> None:
        self.graph = graph
        self.found: dict = {}  # expression -> int, node, or None
        self.symbols, self.dims = {}, {}  # expression -> SymInt placeholder; -> (placeholder tensor, dim)
        for placeholder in graph.find_nodes(op="placeholder"):
            value = placeholder.meta.get("val")
            if isinstance(value, torch.SymInt):
                self.symbols.setdefault(value.node.expr, placeholder)
            elif isinstance(value, torch.Tensor):
                for dim, size in enumerate(value.shape):
                    if isinstance(size, torch.SymInt):
                        self.dims.setdefault(size.node.expr, (placeholder, dim))

    def of(self, size):
        """``size`` as an int, or a node computing it from the inputs, or None."""
        from torch.fx.experimental.symbolic_shapes import is_concrete_int

        return int(size) if is_concrete_int(size) else self._expression(size.node.expr)

    def _expression(self, expr):
        if expr not in self.found:
            self.found[expr] = self._build(expr)
        return self.found[expr]

    def _build(self, expr):
        if expr.is_Integer:
            return int(expr)
        if expr in self.symbols:
            return self.symbols[expr]
        if expr in self.dims:
            return _fx_call(self.graph, aten.sym_size.int, *self.dims[expr])
        natural_power = expr.is_Pow and expr.exp.is_Integer and expr.exp > 0
        combine = _SIZE_ARITHMETIC.get(type(expr)) or (operator.add if expr.is_Add else operator.mul if expr.is_Mul
                                                        else operator.pow if natural_power else None)
        if combine is None:
            return None
        terms = [self._expression(term) for term in expr.args]
        if any(term is None for term in terms):
            return None
        result = terms[0]
        for term in terms[1:]:
            result = _fx_call(self.graph, combine, result, term)
        return result


def sizes_from_inputs(gm: torch.fx.GraphModule) -> int:
    """After AOTAutograd, with dynamic shapes: a size or element count read off a tensor the
    graph computes (``sym_size.int(h, 0)``, ``sym_numel(h)``) is computed from the graph's
    inputs instead, where they have its symbols (sums, products, powers, floor divisions,
    remainders, max and min of them). Else the size, and the shape arithmetic PyTorch does with
    it, waits for that tensor: the ORT partition that makes it ends there and another begins
    (HF GPT-2's forward ran as two, SegFormer's as seven). Returns how many sizes now come from
    the inputs."""
    sizes = _InputSizes(gm.graph)

    def read_off_a_computed_tensor(node) -> bool:
        return (_call(node, aten.sym_size.int) or _call(node, aten.sym_numel.default)) \
            and node.args[0].op != "placeholder" and isinstance(node.meta.get("val"), torch.SymInt)

    return _replace_calls(gm, read_off_a_computed_tensor, lambda node: sizes.of(node.meta["val"]))


def _replace_calls(gm: torch.fx.GraphModule, matches, replacement) -> int:
    """Each node ``matches`` accepts is replaced by the node ``replacement(node)`` makes before
    it (None: it stays). Returns how many were replaced."""
    graph, replaced = gm.graph, 0
    for node in list(graph.nodes):
        if not matches(node):
            continue
        with graph.inserting_before(node):
            new = replacement(node)
        if new is None:
            continue
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        replaced += 1
    if replaced:
        gm.recompile()
    return replaced


_SQUEEZES = (aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims)


def squeezes_as_traced(gm: torch.fx.GraphModule) -> int:
    """After AOTAutograd, with dynamic shapes: a squeeze that took out a dim of symbolic size
    (one PyTorch found to be 1 and guarded, such as ``n // 8`` or ``out // in - 3``) becomes a
    select of index 0 on each dim it took out. The ONNX lowering sees only the symbol, cannot
    tell such a size from any other, and left the dim in: ranks disagreed downstream, with a
    broadcast's result silently of the wrong shape. Returns how many squeezes changed."""
    from torch.fx.experimental.symbolic_shapes import is_concrete_int

    def as_selects(node):
        before, after = _example(node.args[0]), node.meta.get("val")
        if not isinstance(before, torch.Tensor) or not isinstance(after, torch.Tensor) or before.dim() == 0:
            return None
        asked = range(before.dim()) if len(node.args) < 2 else node.args[1]
        asked = {d % before.dim() for d in ([asked] if isinstance(asked, int) else asked)}
        taken = _taken_out(before.shape, after.shape, asked)
        if taken is None or all(is_concrete_int(before.shape[d]) for d in taken):
            return None  # no symbolic size taken out: the lowering's case
        out = node.args[0]
        for d in reversed(taken):
            out = _fx_call(gm.graph, aten.select.int, out, d, 0)
        return out

    return _replace_calls(gm, lambda node: any(_call(node, squeeze) for squeeze in _SQUEEZES), as_selects)


def _taken_out(before, after, asked) -> list | None:
    """The dims of ``asked`` that a squeeze from shape ``before`` to ``after`` took out, read by
    matching sizes' expressions (comparing the SymInts would add guards); None if they do not
    line up."""
    def key(size):
        return size.node.expr if isinstance(size, torch.SymInt) else size

    taken, kept = [], 0
    for d, size in enumerate(before):
        if kept < len(after) and key(size) == key(after[kept]):
            kept += 1
        elif d in asked:
            taken.append(d)
        else:
            return None
    return taken if kept == len(after) else None
