"""What compiling costs a first step, beside the ORT runs: Python's garbage collector waits
until a graph has compiled (docs/performance-log.md, "The collector paused while graphs compile")."""

import gc

import pytest
import torch

from ort_dynamo import partition


@pytest.fixture
def collector_seen_by_partition(monkeypatch):
    """Whether the collector was on, each time a graph reached the partition stage."""
    seen = []
    real = partition.partition

    def watching(*args, **kwargs):
        seen.append(gc.isenabled())
        return real(*args, **kwargs)

    monkeypatch.setattr(partition, "partition", watching)
    torch._dynamo.reset()
    yield seen
    torch._dynamo.reset()


def _train_once():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    torch.compile(model, backend="ort")(torch.randn(3, 4)).sum().backward()


def test_the_collector_pauses_while_forward_and_backward_compile_and_runs_again_after(collector_seen_by_partition):
    assert gc.isenabled()
    _train_once()
    # The forward graph compiles inside the backend's call; the backward one at the first
    # backward, from AOTAutograd: both with the collector paused.
    assert collector_seen_by_partition == [False, False]
    assert gc.isenabled()


def test_a_collector_the_application_turned_off_stays_off(collector_seen_by_partition):
    gc.disable()
    try:
        _train_once()
        assert not gc.isenabled()
    finally:
        gc.enable()
    assert collector_seen_by_partition == [False, False]


def test_a_failed_compile_turns_the_collector_back_on():
    def failing(*args, **kwargs):
        raise RuntimeError("a lowering broke")

    real = partition.partition
    partition.partition = failing
    try:
        torch._dynamo.reset()
        with pytest.raises(Exception, match="a lowering broke"):
            torch.compile(torch.nn.Linear(2, 2), backend="ort")(torch.randn(1, 2))
    finally:
        partition.partition = real
        torch._dynamo.reset()
    assert gc.isenabled()


@torch.library.custom_op("ort_dynamo_tests::halved", mutates_args=())
def _halved(x: torch.Tensor) -> torch.Tensor:
    return x / 2


@_halved.register_fake
def _(x):
    return torch.empty_like(x)


@pytest.fixture
def partitions_made(monkeypatch):
    """The ``Partitioned`` of each graph that reached the partition stage."""
    made = []
    real = partition.partition

    def recording(*args, **kwargs):
        made.append(real(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(partition, "partition", recording)
    torch._dynamo.reset()
    yield made
    torch._dynamo.reset()


@pytest.mark.parametrize("cache", [False, True])
def test_partitions_that_run_on_ort_never_become_python_code(partitions_made, tmp_path, cache):
    """Export reads a partition's graph and the cache key its code's text: neither needs the
    code compiled, which took a tenth of a second of BERT's first step."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    options = {"cache_dir": str(tmp_path)} if cache else {}
    torch.compile(model, backend="ort", options=options)(torch.randn(3, 4)).sum().backward()
    runners = [getattr(p.module, name).runner for p in partitions_made for name in p.ort_submodules]
    assert len(runners) == 2  # forward, backward
    assert all(r.torch_fn._needs_recompile() for r in runners)


def test_a_partition_pytorch_runs_after_ort_failed_becomes_code_then(partitions_made, monkeypatch):
    """A node left in PyTorch between the two nodes of one partition, reading the first: the
    partition's call takes the place of its last node, so the split graph is reordered. When
    ORT then fails, PyTorch runs the partition, compiled to Python at that first call, with
    eager's values."""
    from ort_dynamo import run

    def f(x):
        a = torch.sin(x)
        b = _halved(a)  # no ONNX lowering: stays in PyTorch
        return b, torch.cos(x)

    def failing_run(self, args):
        raise RuntimeError("simulated ORT crash")

    x = torch.randn(5)
    compiled = torch.compile(f, backend="ort")
    torch.testing.assert_close(compiled(x), f(x))
    split = partitions_made[0].module
    split.graph.lint()  # every node after its inputs
    subs = [getattr(split, name).runner.torch_fn for name in partitions_made[0].ort_submodules]
    assert len(subs) == 1 and all(sub._needs_recompile() for sub in subs)
    monkeypatch.setattr(run.OrtRunner, "_run", failing_run)
    with pytest.warns(UserWarning, match="simulated ORT crash"):
        torch.testing.assert_close(compiled(x), f(x))
    assert not any(sub._needs_recompile() for sub in subs)
