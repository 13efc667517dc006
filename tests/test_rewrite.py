"""Rewrites: ORT's fused kernels appear in the optimized graphs, and results do not change."""

import collections
import glob
import os

import onnx
import onnxruntime as ort
import torch
import torch.nn as nn

import ort_dynamo
from ort_dynamo.options import OrtOptions
from ort_dynamo.run import session_options


def _optimized_op_types(path):
    so = session_options(OrtOptions())
    so.optimized_model_filepath = path + ".optimized"
    ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    return collections.Counter(n.op_type for n in onnx.load(path + ".optimized").graph.node)


def test_backward_matmuls_fuse_into_fused_matmul_with_same_gradients(tmp_path):
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    x = torch.randn(8, 16)
    grads = {}
    for level in ("all", "disable"):
        ort_dynamo.reset()
        clone = nn.Sequential(*[m for m in model])  # same parameters
        clone.zero_grad()
        opts = {"graph_optimization_level": level, "save_onnx": True, "save_path": str(tmp_path / level)}
        torch.compile(clone, backend="ort", options=opts)(x).square().sum().backward()
        grads[level] = [p.grad.clone() for p in clone.parameters()]
    backward = glob.glob(os.path.join(tmp_path, "all", "*backward*.onnx"))[0]
    assert _optimized_op_types(backward)["FusedMatMul"] >= 1
    for fused, plain in zip(grads["all"], grads["disable"]):
        torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-6)


def test_bfloat16_ops_run_on_cpu_in_float32_with_bf16_rounding(tmp_path):
    """ORT's CPU EP lacks bf16 kernels: the rewrite computes in fp32 and rounds each result,
    which is also what eager does on CPU, so results match eager bit for bit here."""
    a = torch.randn(64, dtype=torch.bfloat16)
    b = torch.randn(64, dtype=torch.bfloat16)

    def fn(a, b):
        return (a * b + a).tanh()

    got = torch.compile(fn, backend="ort", options={"save_onnx": True, "save_path": str(tmp_path)})(a, b)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, fn(a, b), rtol=0, atol=0)
    assert ort_dynamo.report().fallback_nodes == 0
    model = onnx.load(glob.glob(str(tmp_path / "*.onnx"))[0])
    casts = [n for n in model.graph.node if n.op_type == "Cast"]
    assert len(casts) >= 4  # up-casts of a and b, down-casts of each op's result
