"""In-place mutation and aliasing stay correct on ORT (cf. ORTModule's PythonOp in-place fix).

ORT computes functional graphs; AOTAutograd writes mutations back to the real inputs and
buffers and rebuilds views of inputs in PyTorch. What must hold, as in eager:
mutated inputs/buffers end with eager's values, returned views alias what eager's alias,
a tensor returned twice stays one value, and no ORT output shares memory with a tensor
PyTorch still owns (a later in-place write to an input must not change earlier results).
"""

from __future__ import annotations

import copy

import torch

import ort_dynamo

TOL = dict(rtol=1e-5, atol=1e-6)


def ort(fn):
    return torch.compile(fn, backend="ort", dynamic=False)


class RunningStats(torch.nn.Module):
    """Mutates its buffers in place every call (like BatchNorm's running stats)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.register_buffer("ema", torch.zeros(8))
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(x)
        self.ema.mul_(0.9).add_(0.1 * h.detach().mean(0))
        self.calls += 1
        return (h - self.ema).pow(2).mean()


def three_steps_like_eager(model_type) -> tuple[torch.nn.Module, torch.nn.Module]:
    """An eager model and its ort copy after three steps whose losses match; both returned."""
    torch.manual_seed(0)
    eager = model_type()
    compiled_model = copy.deepcopy(eager)
    step = ort(compiled_model)
    for _ in range(3):
        x = torch.randn(4, 8)
        e_loss, o_loss = eager(x), step(x)
        e_loss.backward()
        o_loss.backward()
        torch.testing.assert_close(o_loss, e_loss, **TOL)
    return eager, compiled_model


def test_buffers_mutated_in_place_match_eager_over_steps():
    eager, compiled_model = three_steps_like_eager(RunningStats)
    torch.testing.assert_close(compiled_model.ema, eager.ema, **TOL)
    assert compiled_model.calls.item() == eager.calls.item() == 3
    torch.testing.assert_close(compiled_model.linear.weight.grad, eager.linear.weight.grad, **TOL)
    assert ort_dynamo.report().fallback_nodes == 0


class ScaledBySteps(torch.nn.Module):
    """Counts its calls in a buffer and multiplies by the count: backward needs the new count."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.register_buffer("steps", torch.zeros(()))
        self.register_buffer("gains", torch.ones(2, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps.add_(1)
        self.gains.mul_(1.5)
        return (self.linear(x) * self.steps * self.gains[1].view(1, 8)).tanh().sum()


def test_a_buffer_mutated_in_forward_and_read_by_backward_trains_like_eager():
    # Recompute (the default memory_opt_level=1) must not recompute the new count from the
    # buffer, which holds it only after the forward: it failed autograd's version check.
    eager, compiled_model = three_steps_like_eager(ScaledBySteps)
    assert compiled_model.steps.item() == eager.steps.item() == 3
    torch.testing.assert_close(compiled_model.gains, eager.gains, **TOL)
    # three steps scaled by up to 3 * 3.4 each: float32 rounding of that size
    torch.testing.assert_close(compiled_model.linear.weight.grad, eager.linear.weight.grad, rtol=1e-4, atol=1e-5)
    assert ort_dynamo.report().fallback_nodes == 0


def test_batchnorm_running_stats_in_training():
    torch.manual_seed(0)
    eager = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU())
    compiled_model = copy.deepcopy(eager)
    step = ort(compiled_model)
    for _ in range(2):
        x = torch.randn(2, 3, 6, 6)
        torch.testing.assert_close(step(x), eager(x), **TOL)
    bn_e, bn_o = eager[1], compiled_model[1]
    torch.testing.assert_close(bn_o.running_mean, bn_e.running_mean, **TOL)
    torch.testing.assert_close(bn_o.running_var, bn_e.running_var, **TOL)
    assert bn_o.num_batches_tracked.item() == bn_e.num_batches_tracked.item() == 2
    assert ort_dynamo.report().fallback_nodes == 0


def test_inputs_mutated_in_place():
    def fn(x, y):
        x.add_(1.0)
        y[:, 0] = x.sum(1)  # in-place write into a slice of another input
        return x * y

    x, y = torch.randn(3, 4), torch.randn(3, 4)
    xe, ye = x.clone(), y.clone()
    expected = fn(xe, ye)
    out = ort(fn)(x, y)
    torch.testing.assert_close(out, expected, **TOL)
    torch.testing.assert_close(x, xe, **TOL)
    torch.testing.assert_close(y, ye, **TOL)
    assert ort_dynamo.report().fallback_nodes == 0


def test_returned_views_alias_the_input_like_eager():
    def fn(x):
        return x[1:], x.t(), x.view(-1), torch.sin(x)

    x = torch.randn(3, 4)
    rows, transposed, flat, sines = ort(fn)(x)
    torch.testing.assert_close(rows, x[1:])
    # Views of an input must stay views: a later write to x shows through them, as in eager.
    x.mul_(2.0)
    torch.testing.assert_close(rows, x[1:])
    torch.testing.assert_close(transposed, x.t())
    torch.testing.assert_close(flat, x.view(-1))
    # ...but a computed result must not: ORT's output buffer is its own.
    torch.testing.assert_close(sines, torch.sin(x / 2.0), **TOL)


def test_same_tensor_returned_twice_and_gradients():
    def fn(x):
        y = torch.tanh(x) * 2.0
        return y, y

    x = torch.randn(5, requires_grad=True)
    xe = x.detach().clone().requires_grad_()
    a, b = ort(fn)(x)
    ae, be = fn(xe)
    torch.testing.assert_close(a, ae, **TOL)
    torch.testing.assert_close(b, be, **TOL)
    (3.0 * a + 5.0 * b).sum().backward()
    (3.0 * ae + 5.0 * be).sum().backward()
    torch.testing.assert_close(x.grad, xe.grad, **TOL)
    assert ort_dynamo.report().fallback_nodes == 0


def test_outputs_never_share_memory_with_inputs_or_earlier_outputs():
    def fn(x):
        return x.clone(), x + 0.0, x.reshape(-1).contiguous() * 1.0

    step = ort(fn)
    x = torch.randn(4, 4)
    snapshot = x.clone()
    first = step(x)
    for out in first:
        assert out.data_ptr() != x.data_ptr()
    x.add_(100.0)  # PyTorch writes into the input ORT read
    second = step(torch.randn(4, 4))  # and ORT runs again
    torch.testing.assert_close(first[0], snapshot)
    torch.testing.assert_close(first[1], snapshot)
    torch.testing.assert_close(first[2], snapshot.reshape(-1))
    assert {o.data_ptr() for o in first}.isdisjoint(o.data_ptr() for o in second)


def test_lowering_that_returns_its_input_still_yields_a_fresh_result():
    # torchlib lowers t() of a 1-D tensor (the backward of t_copy) and mean over a 0-d
    # tensor's only dim to "return the input": the ONNX graph output is its input.
    x = torch.randn(2, requires_grad=True)
    weight = torch.rand(2)
    out = ort(torch.t_copy)(x)
    (grad,) = torch.autograd.grad((out * weight).sum(), x)
    torch.testing.assert_close(grad, weight)
    scalar = torch.randn(())
    torch.testing.assert_close(ort(lambda s: torch.mean(s, dim=0, keepdim=True))(scalar), scalar)
    assert ort_dynamo.report().fallback_nodes == 0
