"""Shared helpers: train a model eagerly and under backend="ort", compare step by step."""

from __future__ import annotations

import copy
import socket
from typing import Callable

import torch

import ort_dynamo


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now: for process groups, which pytest-xdist's workers
    start side by side (a fixed port would collide)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torch_older_than(*version: int) -> bool:
    """Whether the running torch is older than ``version``: for tests of what older ones lack."""
    return torch.torch_version.TorchVersion(torch.__version__) < version


def train_both(model: torch.nn.Module, batch: Callable[[], dict | tuple], loss_of: Callable,
               steps: int = 3, options: dict | None = None, lr: float = 0.1, **compile_kw):
    """Run ``steps`` SGD steps on a copy in eager and a copy under ort; return both losses.

    SGD (not Adam): Adam divides by sqrt(v), which turns the rounding noise of parameters whose
    true gradient is 0 (e.g. attention key biases) into lr-sized updates, hiding real parity.
    """
    eager, compiled_model = model, copy.deepcopy(model)
    compiled = torch.compile(compiled_model, backend="ort", options=options or {}, **compile_kw)
    opt_e = torch.optim.SGD(eager.parameters(), lr=lr)
    opt_o = torch.optim.SGD(compiled_model.parameters(), lr=lr)
    losses_e, losses_o = [], []
    for _ in range(steps):
        args = batch()
        for fn, opt, losses in ((eager, opt_e, losses_e), (compiled, opt_o, losses_o)):
            out = fn(**args) if isinstance(args, dict) else fn(*args)
            loss = loss_of(out)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    return eager, compiled_model, losses_e, losses_o


def assert_same_training(eager, compiled_model, losses_e, losses_o, rtol=1e-5, atol=1e-6):
    torch.testing.assert_close(torch.tensor(losses_o), torch.tensor(losses_e), rtol=rtol, atol=0)
    for (name, p_e), p_o in zip(eager.named_parameters(), compiled_model.parameters()):
        torch.testing.assert_close(p_o, p_e, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")
    for (name, b_e), b_o in zip(eager.named_buffers(), compiled_model.buffers()):
        torch.testing.assert_close(b_o, b_e, rtol=rtol, atol=atol, msg=lambda m: f"buffer {name}: {m}")


def assert_all_on_ort():
    report = ort_dynamo.report()
    assert report.ort_nodes > 0, str(report)
    assert report.fallback_nodes == 0, str(report)
    assert report.runs > 0, str(report)


def partition_runner(fn: Callable, *examples: torch.Tensor):
    """``fn`` traced, exported, rewritten and ready to run as one ORT partition, the way
    capture hands a partition to the run stage. Returns (exported graph, runner)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from ort_dynamo.export import export_graph
    from ort_dynamo.options import OrtOptions
    from ort_dynamo.report import GraphReport
    from ort_dynamo.rewrite import rewrite
    from ort_dynamo.run import OrtRunner

    gm = make_fx(fn, tracing_mode="fake")(*examples)
    exported = export_graph(gm)
    model_bytes = rewrite(exported, OrtOptions())
    return exported, OrtRunner(exported, model_bytes, OrtOptions(), GraphReport("test", "inference"), gm, "fused_0")
