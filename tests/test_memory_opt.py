"""memory_opt_level=1 recomputes cheap activations in backward instead of saving them."""

import copy

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


def _saved_shapes(level, model, x):
    """Shapes of the tensors the compiled forward saves for backward, and the gradients."""
    ort_dynamo.reset()
    saved = []

    def pack(tensor):
        saved.append(tuple(tensor.shape))
        return tensor

    compiled = torch.compile(copy.deepcopy(model), backend="ort", options={"memory_opt_level": level})
    compiled(x).sum().backward()  # compiles
    compiled.zero_grad()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = compiled(x).sum()
    loss.backward()
    assert_all_on_ort()
    return saved, [p.grad for p in compiled.parameters()]


def test_recompute_does_not_save_an_activation_the_next_linear_reads():
    """Eager saves both a GELU's input (for its own gradient) and its output (for the next
    Linear's weight gradient). At level 1 the output is recomputed from the input in backward:
    the [tokens, 4 * hidden] tensors saved go from two to one, the gradients stay eager's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
    x = torch.randn(32, 16)
    model(x).sum().backward()
    wide = (32, 64)
    saved_keep, grads_keep = _saved_shapes(0, model, x)
    saved_recompute, grads_recompute = _saved_shapes(1, model, x)
    assert saved_keep.count(wide) == 2, saved_keep
    assert saved_recompute.count(wide) == 1, saved_recompute
    for got_keep, got_recompute, (name, want) in zip(grads_keep, grads_recompute, model.named_parameters()):
        torch.testing.assert_close(got_keep, want.grad, rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(got_recompute, want.grad, rtol=1e-5, atol=1e-6, msg=name)
