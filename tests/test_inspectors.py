"""Input density and memory statistics, printed per step (ORTMODULE_PRINT_* options)."""

import re

import pytest
import torch

import ort_dynamo
from ort_dynamo import OrtOptions
from ort_dynamo.inspectors import attach, memory_stats


class PaddedLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 8, padding_idx=0)
        self.head = torch.nn.Linear(8, 10)

    def forward(self, input_ids, labels=None):
        logits = self.head(self.embed(input_ids))
        if labels is None:
            return logits
        return torch.nn.functional.cross_entropy(logits.view(-1, 10), labels.view(-1), ignore_index=-100)


def _batch():
    # 12 ids, 5 of them padding (0); 12 labels, 3 of them ignored (-100).
    ids = torch.tensor([[3, 4, 5, 0, 0, 0], [7, 8, 9, 2, 0, 0]])
    labels = torch.tensor([[4, 5, -100, 1, 2, 3], [8, 9, 2, -100, -100, 1]])
    return ids, labels


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "ort"])
def test_input_density_counts_padding_and_ignored_labels(compiled):
    model = PaddedLM()
    ids, labels = _batch()
    eager_loss = model(ids, labels)
    lines = []
    inspectors = attach(model, OrtOptions(print_input_density=True), printer=lines.append)
    runner = torch.compile(model, backend="ort") if compiled else model
    loss = runner(ids, labels=labels)
    loss.backward()
    runner(ids[:1, :4])  # second step: 4 ids, 1 padding; no labels
    torch.testing.assert_close(loss, eager_loss)
    assert lines == [
        "[ort_dynamo] step 0 input density: label labels (ignore_index=-100): 9/12 valid (75.00% density); "
        "embedding embed (padding_idx=0): 7/12 valid (58.33% density)",
        "[ort_dynamo] step 1 input density: embedding embed (padding_idx=0): 3/4 valid (75.00% density)",
    ]
    if compiled:
        assert ort_dynamo.report().ort_nodes > 0
    inspectors.detach()
    model(ids)
    assert len(lines) == 2


def test_memory_stats_follow_a_known_allocation():
    model = PaddedLM()
    lines = []
    attach(model, {"print_memory_stats": True}, printer=lines.append)
    ids, _ = _batch()
    model(ids)
    held = torch.ones(64 * 1024 * 1024, dtype=torch.float32)  # 256 MiB, touched
    model(ids)
    rss = [float(re.search(r"rss_mib ([\d.]+)", line).group(1)) for line in lines]
    peak = [float(re.search(r"peak_rss_mib ([\d.]+)", line).group(1)) for line in lines]
    assert lines[0].startswith("[ort_dynamo] step 0 memory (MiB): rss_mib ")
    assert lines[1].startswith("[ort_dynamo] step 1 memory (MiB): rss_mib ")
    assert 240 <= rss[1] - rss[0] <= 272
    assert peak[1] >= rss[1] - 1
    assert memory_stats()["rss_mib"] >= rss[1] - 16
    del held


def test_cuda_memory_stats_include_the_devices_memory_in_use_where_orts_arena_lives(monkeypatch):
    """ORT's CUDA tensors come from its own arena, which PyTorch's allocator figures leave out:
    the stats also give the device's memory in use. (Without a GPU: torch.cuda stand-ins.)"""
    mib = 1024 * 1024
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 100 * mib)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 128 * mib)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 120 * mib)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1000 * mib, 1900 * mib))
    assert memory_stats(torch.device("cuda", 0)) == {
        "allocated_mib": 100.0, "reserved_mib": 128.0, "peak_allocated_mib": 120.0, "device_used_mib": 900.0}


def test_env_variable_turns_inspector_on(monkeypatch):
    model = PaddedLM()
    assert attach(model, None) is None  # both options off: nothing installed
    monkeypatch.setenv("ORTMODULE_PRINT_INPUT_DENSITY", "1")
    lines = []
    attach(model, None, printer=lines.append)
    model(_batch()[0])
    assert lines == ["[ort_dynamo] step 0 input density: embedding embed (padding_idx=0): 7/12 valid (58.33% density)"]
    with pytest.raises(TypeError, match="needs a torch.nn.Module"):
        attach("model", None)
