"""A CI-sized slice of the OpInfo sweep (tools/opinfo_sweep.py; full results in docs/ops.md).

Ops that real models emit, forward and backward, each on its first 3 OpInfo sample inputs:
``backend="ort"`` must match eager (rtol 1e-4, atol 1e-5) with no node left in PyTorch.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

pytest.importorskip("expecttest", reason="torch's OpInfo database imports expecttest (pip install expecttest)")

_SWEEP_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "opinfo_sweep.py")
_spec = importlib.util.spec_from_file_location("opinfo_sweep", _SWEEP_PATH)
sweep = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sweep)

MODEL_OPS = [
    # elementwise, matmul
    "add", "mul", "div.no_rounding_mode", "pow", "where", "masked_fill", "clamp",
    "matmul", "mv", "addmm", "addmv", "bmm", "nn.functional.linear", "einsum",
    # activations, norms, losses
    "softmax", "log_softmax", "nn.functional.gelu", "nn.functional.silu", "nn.functional.relu",
    "tanh", "sigmoid", "nn.functional.layer_norm", "nn.functional.group_norm",
    "nn.functional.batch_norm", "nn.functional.rms_norm", "nn.functional.cross_entropy",
    "nn.functional.nll_loss", "nn.functional.mse_loss", "nn.functional.binary_cross_entropy_with_logits",
    # conv, pooling, upsampling
    "nn.functional.conv1d", "nn.functional.conv2d", "nn.functional.avg_pool2d",
    "nn.functional.max_pool2d", "nn.functional.adaptive_avg_pool2d", "nn.functional.interpolate.nearest",
    "nn.functional.interpolate.bilinear", "nn.functional.pad.constant",
    # indexing, scatter/gather
    "nn.functional.embedding", "index_put", "index_add", "index_select", "gather", "scatter_add",
    "scatter_reduce.mean", "diagonal_scatter", "as_strided_scatter", "take_along_dim",
    # reductions, cumulative, sorting
    "sum", "mean", "var_mean", "cumsum", "sort", "argsort", "topk", "roll",
    # gaps the sweep found, closed in lower.py / lowerings.py / export.py
    "cumprod", "cummax", "median", "kthvalue", "prod", "amax", "max.reduction_with_dim",
    "nn.functional.avg_pool3d", "nn.functional.adaptive_avg_pool1d", "nn.functional.conv_transpose1d",
    "nn.functional.embedding_bag", "nn.functional.adaptive_max_pool2d", "nn.functional.grid_sample",
    "cdist", "searchsorted", "block_diag", "nn.functional.pixel_shuffle", "lgamma", "special.i0e",
    "linalg.solve", "linalg.det",
]

_OPS = None


def _op(name: str):
    global _OPS
    if _OPS is None:
        _OPS = sweep._float32_ops()
    return _OPS[name]


@pytest.mark.parametrize("name", MODEL_OPS)
def test_op_matches_eager_on_ort(name):
    result = sweep.run_one_op(_op(name), samples=3)
    assert result["samples"] > 0, f"{name}: no sample ran ({result['detail']})"
    assert result["status"] == "pass", f"{name}: {result['status']}: {result['detail']}"
    assert result["fallback_nodes"] == 0, f"{name}: fell back: {result['fallbacks']}"
    assert result["ort_nodes"] > 0, f"{name}: nothing ran on ORT"


def test_sweep_flags_a_wrong_result():
    """The harness itself can fail: a lowering that returns the wrong value is a mismatch."""
    op = _op("nn.functional.relu")
    original = op.op
    try:
        op.op = lambda x, *a, **k: original(x, *a, **k) + (1.0 if torch.compiler.is_compiling() else 0.0)
        result = sweep.run_one_op(op, samples=1)
    finally:
        op.op = original
    assert result["status"] == "mismatch", result
