"""What compiling costs a first step, beside the ORT runs: Python's garbage collector waits
until a graph has compiled (docs/performance.md, "The collector paused while graphs compile")."""

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
