"""print_input_density / print_memory_stats as backend options print real numbers per step."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class Tagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8, padding_idx=0)
        self.out = nn.Linear(8, 5)

    def forward(self, ids, labels):
        logits = self.out(self.emb(ids))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


def test_input_density_and_memory_printed_per_step(capsys):
    ids = torch.tensor([[3, 4, 0, 0], [5, 0, 0, 0], [1, 2, 3, 4]])  # 5 of 12 are padding
    labels = torch.tensor([[1, 2, -100, -100], [3, -100, -100, -100], [1, 1, 2, -100]])  # 6 of 12 ignored
    model = torch.compile(Tagger(), backend="ort",
                          options={"print_input_density": True, "print_memory_stats": True})
    for _ in range(2):
        model(ids, labels).backward()
    out = capsys.readouterr().out
    assert "forward_0 step 0 input density" in out and "forward_0 step 1 input density" in out
    assert "(padding_idx=0): 7/12 valid (58.33% density)" in out
    assert "(ignore_index=-100): 6/12 valid (50.00% density)" in out
    assert "forward_0 step 1 memory (MiB): rss_mib" in out
    rss = float(out.split("memory (MiB): rss_mib ")[1].split(",")[0])
    assert rss > 50  # a process with torch loaded holds far more than 50 MiB


def test_env_var_turns_density_on(monkeypatch, capsys):
    monkeypatch.setenv("ORTMODULE_PRINT_INPUT_DENSITY", "1")
    ids = torch.tensor([[1, 0]])
    torch.compile(Tagger(), backend="ort")(ids, torch.tensor([[1, -100]])).backward()
    assert "1/2 valid (50.00% density)" in capsys.readouterr().out
