"""Flash attention for CPU as ``ort_dynamo.torch`` custom ops: PyTorch's own fused kernel, called
from inside the ORT session (``csrc/torch_attention.c``, option ``cpu_torch_attention``).

Only graphs traced with that option keep ``_scaled_dot_product_flash_attention_for_cpu`` and its
backward (``lower.flash_for_cpu_applies``: float32, four dimensions, no dropout); elsewhere the
decomposition table writes them out as products and a softmax before export.
"""

from __future__ import annotations

import torch
from onnx.defs import OpSchema
from onnxscript.values import Op, Opset

from .._torch_attention import DOMAIN

aten = torch.ops.aten

_OPSET = Opset(DOMAIN, 1)
_TENSOR = OpSchema.FormalParameter
_OPTIONAL = OpSchema.FormalParameterOption.Optional
_ATTRIBUTES = [OpSchema.Attribute("is_causal", OpSchema.AttrType.INT, ""),
               OpSchema.Attribute("has_scale", OpSchema.AttrType.INT, ""),
               OpSchema.Attribute("scale", OpSchema.AttrType.FLOAT, "", required=False)]
_TYPES = [("T", ["tensor(float)"], ""), ("M", ["tensor(float)", "tensor(bool)"], "")]


def _op(name: str, inputs: list[str], outputs: list[str]) -> Op:
    schema = OpSchema(name, DOMAIN, 1,
                      inputs=[_TENSOR(i, "M", param_option=_OPTIONAL) if i == "attn_mask" else _TENSOR(i, "T")
                              for i in inputs],
                      outputs=[_TENSOR(o, "T") for o in outputs], type_constraints=_TYPES, attributes=_ATTRIBUTES)
    return Op(_OPSET, name, schema)


_FORWARD = _op("FlashAttentionCpu", ["query", "key", "value", "attn_mask"], ["out", "logsumexp"])
_BACKWARD = _op("FlashAttentionCpuGrad", ["grad_out", "query", "key", "value", "out", "logsumexp", "attn_mask"],
                ["grad_query", "grad_key", "grad_value"])


def _attributes(is_causal: bool, scale) -> dict:
    attributes = {"is_causal": int(bool(is_causal)), "has_scale": int(scale is not None)}
    if scale is not None:
        attributes["scale"] = float(scale)
    return attributes


def flash_attention_for_cpu(query, key, value, dropout_p: float = 0.0, is_causal: bool = False,
                            attn_mask=None, scale: float | None = None):
    """(out, logsumexp) of torch's flash attention for CPU."""
    inputs = [query, key, value] + ([attn_mask] if attn_mask is not None else [])
    return _FORWARD(*inputs, **_attributes(is_causal, scale), _num_outputs=2)


def flash_attention_for_cpu_backward(grad_out, query, key, value, out, logsumexp, dropout_p: float,
                                     is_causal: bool, attn_mask=None, scale: float | None = None):
    """(grad_query, grad_key, grad_value) of torch's flash attention for CPU."""
    inputs = [grad_out, query, key, value, out, logsumexp] + ([attn_mask] if attn_mask is not None else [])
    return _BACKWARD(*inputs, **_attributes(is_causal, scale), _num_outputs=3)


LOWERINGS = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: flash_attention_for_cpu,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: flash_attention_for_cpu_backward,
}
