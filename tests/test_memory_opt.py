"""memory_opt_level=1 recomputes cheap activations in backward instead of saving them."""

import torch
import torch.nn as nn

import ort_dynamo
from parity import assert_all_on_ort


def _saved_for_backward(level):
    ort_dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.LayerNorm(32)) for _ in range(3)])
    x = torch.randn(8, 32, requires_grad=True)
    out = torch.compile(model, backend="ort", options={"memory_opt_level": level})(x)
    out.square().sum().backward()
    assert_all_on_ort()
    forward = next(g for g in ort_dynamo.report().graphs if g.kind == "forward")
    return forward.outputs - 1, out.detach(), x.grad, [p.grad for p in model.parameters()]


def test_recompute_saves_fewer_tensors_with_identical_gradients():
    saved_keep, out_keep, xgrad_keep, grads_keep = _saved_for_backward(0)
    saved_recompute, out_re, xgrad_re, grads_re = _saved_for_backward(1)
    assert saved_recompute < saved_keep, (saved_recompute, saved_keep)
    torch.testing.assert_close(out_re, out_keep)
    torch.testing.assert_close(xgrad_re, xgrad_keep, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads_re, grads_keep):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
