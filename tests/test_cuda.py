"""CUDA: the CUDA execution provider really runs the graphs (needs a GPU and onnxruntime-gpu)."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ort_dynamo

pytestmark = pytest.mark.cuda


def test_training_on_cuda_uses_cuda_ep_and_matches_eager():
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.LayerNorm(128), nn.Linear(128, 10)).cuda()
    twin = copy.deepcopy(model)
    compiled = torch.compile(twin, backend="ort")
    x, y = torch.randn(32, 64, device="cuda"), torch.randint(0, 10, (32,), device="cuda")
    F.cross_entropy(model(x), y).backward()
    F.cross_entropy(compiled(x), y).backward()
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5)
    report = ort_dynamo.report()
    assert report.fallback_nodes == 0
    providers = {p for g in report.graphs for p in g.providers}
    assert providers == {"CUDAExecutionProvider"}, providers


def test_bf16_autocast_on_cuda_runs_on_ort():
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)).cuda()
    x = torch.randn(16, 64, device="cuda")
    compiled = torch.compile(model, backend="ort")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got, want = compiled(x), model(x)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    assert ort_dynamo.report().fallback_nodes == 0


def test_cpu_scalar_tensor_in_a_cuda_graph():
    """A 0-d CPU tensor mixed into CUDA math is legal in eager; it must reach ORT on the GPU."""
    def fn(x, scale):
        return (x * scale).relu()

    x, scale = torch.randn(8, device="cuda"), torch.tensor(1.5)
    torch.testing.assert_close(torch.compile(fn, backend="ort")(x, scale), fn(x, scale))
    assert ort_dynamo.report().fallback_nodes == 0
