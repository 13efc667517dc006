"""Lower: rewrite the Dynamo graph and pick the decompositions AOTAutograd applies.

Goal: every op that reaches the partitioner either has an ONNX lowering in torchlib
or is decomposed into ops that do. Two mechanisms:

* ``lower_graph`` rewrites the torch-level Dynamo graph before AOTAutograd. Needed for
  ops whose backward autograd would record as a fused kernel with no ONNX lowering
  (SDPA's flash/efficient attention backward): replaced by math, autograd derives a
  backward made of matmul/softmax.
* ``decomposition_table`` is handed to AOTAutograd: torch's decompositions for ops
  torchlib lacks (most ``*_backward`` ops) plus our own for those torch has none of.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.fx
from torch._decomp import core_aten_decompositions, decomposition_table as _torch_decompositions

from .decompositions import own_decompositions

__all__ = ["lower_graph", "decomposition_table"]

aten = torch.ops.aten


def sdpa_math(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
              enable_gqa=False):
    """``F.scaled_dot_product_attention`` in ops ONNX has, differentiable by autograd."""
    q_len, kv_len = query.size(-2), key.size(-2)
    scale = 1.0 / math.sqrt(query.size(-1)) if scale is None else scale
    if enable_gqa and key.size(-3) != query.size(-3):
        repeat = query.size(-3) // key.size(-3)
        key = key.repeat_interleave(repeat, dim=-3)
        value = value.repeat_interleave(repeat, dim=-3)
    scores = torch.matmul(query, key.transpose(-2, -1)) * scale
    if is_causal:
        keep = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask
    probs = torch.softmax(scores, dim=-1)
    if dropout_p > 0.0:
        probs = torch.nn.functional.dropout(probs, p=dropout_p, training=True)
    return torch.matmul(probs, value)


_DYNAMO_REWRITES = {
    torch._C._nn.scaled_dot_product_attention: sdpa_math,
    torch.nn.functional.scaled_dot_product_attention: sdpa_math,
}


def lower_graph(gm: torch.fx.GraphModule) -> int:
    """Replace torch-level calls that would leave ORT-less backward kernels. Returns the count."""
    replaced = 0
    for module in gm.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        for node in module.graph.nodes:
            if node.op == "call_function" and node.target in _DYNAMO_REWRITES:
                node.target = _DYNAMO_REWRITES[node.target]
                replaced += 1
        if replaced:
            module.recompile()
    return replaced


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
#: returns a fake ``total_weight`` (element count), which the backward divides by.
TORCHLIB_WRONG = frozenset({
    aten.nll_loss_forward.default,
    aten.nll_loss2d_forward.default,
    aten._native_batch_norm_legit_functional.default,
    aten._native_batch_norm_legit.default,
    aten._native_batch_norm_legit.no_stats,
    aten.native_batch_norm.default,
})


_NEVER_DECOMPOSE = {aten.lift, aten.lift_fresh, aten.sym_numel, aten.is_same_size}


@functools.lru_cache(None)
def decomposition_table(opset: int = 18, cache_dir: str = "") -> dict:
    """Decompositions for AOTAutograd: only ops that torchlib cannot lower (correctly)."""
    lowered = _onnx_lowered_ops(opset, cache_dir) - TORCHLIB_WRONG
    table = {op: fn for op, fn in core_aten_decompositions().items() if op not in lowered}
    # Beyond the core set: functional ops only (in-place/out variants are gone after
    # functionalization) and never the tensor-lifting ones, which break fake tracing.
    for op, fn in _torch_decompositions.items():
        if (isinstance(op, torch._ops.OpOverload) and op not in lowered
                and op.overloadpacket not in _NEVER_DECOMPOSE
                and not op._schema.name.endswith("_") and "out" not in op._overloadname):
            table.setdefault(op, fn)
    missing = [op for op in TORCHLIB_WRONG if op not in table]
    if missing:
        raise RuntimeError(f"no decomposition for {missing}: their torchlib lowering is wrong")
    table.update(own_decompositions())
    return table
