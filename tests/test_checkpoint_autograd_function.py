"""Activation checkpointing and user autograd.Functions: correct either way, and we know which way.

* ``torch.utils.checkpoint`` (reentrant or not) traces into the ORT graphs: Dynamo captures
  it as one region and AOTAutograd replays the checkpointed forward inside the backward
  graph (what ORTMODULE_ALLOW_AUTOGRAD_CHECKPOINT allowed), so the backward graph grows.
* A traceable ``torch.autograd.Function`` traces into the ORT forward and backward graphs,
  its custom backward included. One whose forward Dynamo cannot trace graph-breaks: the
  Function runs eagerly between two compiled graphs, results still exact.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.utils import counters
from torch.utils.checkpoint import checkpoint

import ort_dynamo

TOL = dict(rtol=1e-5, atol=1e-6)


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(16, 32)
        self.down = torch.nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x)))


class Tower(torch.nn.Module):
    def __init__(self, mode: str) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block(), Block()])
        self.mode = mode  # "none" | "reentrant" | "non_reentrant"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if self.mode == "none":
                x = x + block(x)
            else:
                x = x + checkpoint(block, x, use_reentrant=self.mode == "reentrant")
        return x.pow(2).mean()


def compiled_grads(model: torch.nn.Module, x: torch.Tensor):
    counters.clear()
    loss = torch.compile(model, backend="ort", dynamic=False)(x)
    loss.backward()
    return loss, {n: p.grad for n, p in model.named_parameters()}


def graph_nodes(kind: str) -> int:
    return sum(g.ort_nodes for g in ort_dynamo.report().graphs if g.kind == kind)


@pytest.mark.parametrize("mode", ["non_reentrant", "reentrant"])
def test_checkpoint_recomputes_inside_the_ort_backward_graph(mode):
    torch.manual_seed(0)
    plain = Tower("none")
    x = torch.randn(4, 16, requires_grad=True)

    compiled_grads(copy.deepcopy(plain), x)
    backward_without = graph_nodes("backward")
    ort_dynamo.reset()

    eager_model = copy.deepcopy(plain)
    eager_model.mode = mode
    eager_loss = eager_model(x)
    eager_loss.backward()
    ort_model = copy.deepcopy(plain)
    ort_model.mode = mode
    loss, grads = compiled_grads(ort_model, x)

    report = ort_dynamo.report()
    assert sum(counters["graph_break"].values()) == 0, "checkpoint should trace, not graph-break"
    assert [g.kind for g in report.graphs] == ["forward", "backward"]
    assert report.fallback_nodes == 0
    # The checkpointed blocks' forward ops are replayed in the backward graph.
    assert graph_nodes("backward") > backward_without
    torch.testing.assert_close(loss, eager_loss, **TOL)
    for name, p in eager_model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, **TOL, msg=lambda m: f"grad of {name}: {m}")


class ScaledSquare(torch.autograd.Function):
    """y = s * x^2 with a hand-written backward (deliberately not autograd's own formula)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.scale = scale
        return scale * x * x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (x,) = ctx.saved_tensors
        return 2.0 * ctx.scale * x * grad, None


class HostRoundTrip(torch.autograd.Function):
    """A forward that leaves the tensor world (Python floats): Dynamo cannot trace it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return torch.tensor([3.0 * v for v in x.tolist()], dtype=x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad * 3.0


def test_traceable_autograd_function_runs_in_ort_graphs():
    def fn(x):
        return ScaledSquare.apply(torch.sin(x), 1.5).sum()

    x = torch.randn(6, requires_grad=True)
    counters.clear()
    torch.compile(fn, backend="ort", dynamic=False)(x).backward()

    report = ort_dynamo.report()
    assert sum(counters["graph_break"].values()) == 0
    assert [g.kind for g in report.graphs] == ["forward", "backward"]
    assert report.fallback_nodes == 0 and graph_nodes("backward") > 0
    torch.testing.assert_close(x.grad, 2 * 1.5 * torch.sin(x) * torch.cos(x), **TOL)


def test_untraceable_autograd_function_graph_breaks_and_stays_correct():
    def fn(x):
        h = torch.tanh(x)
        return (HostRoundTrip.apply(h) * h).sum()

    x = torch.randn(6, requires_grad=True)
    counters.clear()
    loss = torch.compile(fn, backend="ort", dynamic=False)(x)
    loss.backward()

    assert sum(counters["graph_break"].values()) > 0, "tolist() must break the graph"
    report = ort_dynamo.report()
    assert report.fallback_nodes == 0 and report.ort_nodes > 0  # the traceable parts ran on ORT
    h = torch.tanh(x.detach())
    torch.testing.assert_close(loss, (3 * h * h).sum(), **TOL)
    # d/dx sum(3h * h) with HostRoundTrip's backward for the first factor: 6 h (1 - h^2).
    torch.testing.assert_close(x.grad, 6 * h * (1 - h * h), **TOL)
