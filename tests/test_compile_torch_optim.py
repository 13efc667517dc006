"""``torch.compile(opt.step, backend="ort")`` for torch's own optimizers."""

import copy

import pytest
import torch

import ort_dynamo

OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "adam": (torch.optim.Adam, dict(lr=1e-2, weight_decay=0.01)),
    "sgd": (torch.optim.SGD, dict(lr=1e-2, momentum=0.9, nesterov=True)),
}


def mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_compiled_step_runs_on_ort_and_matches_eager(name):
    cls, kwargs = OPTIMIZERS[name]
    model = mlp()
    ref_model = copy.deepcopy(model)
    initial = copy.deepcopy(model)
    opt, ref = cls(model.parameters(), **kwargs), cls(ref_model.parameters(), **kwargs)
    compiled_step = torch.compile(opt.step, backend="ort")
    for step in range(4):
        x = torch.randn(4, 8)
        for m in (model, ref_model):
            m.zero_grad()
            m(x).square().mean().backward()
        compiled_step()
        ref.step()
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert not torch.equal(model[0].weight, initial[0].weight)  # it trained
    for key, value in opt.state[next(model.parameters())].items():
        torch.testing.assert_close(value, ref.state[next(ref_model.parameters())][key], rtol=1e-5, atol=1e-7)
    report = ort_dynamo.report()
    assert report.ort_nodes > 0 and report.runs >= 4
    # addcmul decomposes to prims.fma, which lower.py decomposes further: nothing falls back.
    assert report.fallback_nodes == 0, str(report)


def test_tensor_lr_changes_do_not_recompile_a_compiled_torch_optimizer_step():
    """lr as a tensor (PyTorch's advice for compiled optimizers) is a graph input to ORT."""
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.01))
    ref_model = torch.nn.Linear(4, 4)
    ref_model.load_state_dict(model.state_dict())
    ref = torch.optim.AdamW(ref_model.parameters(), lr=0.01)
    step = torch.compile(opt.step, backend="ort")
    for lr in (0.01, 0.005, 0.001):
        opt.param_groups[0]["lr"].fill_(lr)
        ref.param_groups[0]["lr"] = lr
        for m in (model, ref_model):
            m(torch.ones(2, 4)).square().sum().backward()
        step()
        ref.step()
        opt.zero_grad()
        ref.zero_grad()
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    graphs = [g for g in ort_dynamo.report().graphs]
    assert len(graphs) == 1, ort_dynamo.report()  # compiled once, reused for every lr
    assert ort_dynamo.report().fallback_nodes == 0
