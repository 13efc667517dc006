"""Recurrent layers (nn.LSTM, nn.GRU, nn.RNN): Dynamo captures them only with its own switch,
``torch._dynamo.config.allow_rnn``; with it they train on ORT, without it the report says why
they ran in PyTorch."""

import copy

import pytest
import torch
import torch.nn as nn

import ort_dynamo


class Tagger(nn.Module):
    """A recurrent encoder and a per-step classifier, as a sequence tagger is built."""

    def __init__(self, layer: nn.Module, width: int) -> None:
        super().__init__()
        self.rnn = layer
        self.head = nn.Linear(width, 3)

    def forward(self, x):
        return self.head(self.rnn(x)[0])


LAYERS = {
    "lstm": lambda: Tagger(nn.LSTM(6, 8, batch_first=True), 8),
    "lstm_2_layers_bidirectional": lambda: Tagger(nn.LSTM(6, 8, num_layers=2, bidirectional=True), 16),
    "lstm_projected": lambda: Tagger(nn.LSTM(6, 8, proj_size=4, batch_first=True), 4),
    "gru_2_layers": lambda: Tagger(nn.GRU(6, 8, num_layers=2, batch_first=True), 8),
    "rnn_relu_bidirectional": lambda: Tagger(nn.RNN(6, 8, nonlinearity="relu", bidirectional=True), 16),
}


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_recurrent_layers_train_on_ort_with_eagers_gradients_when_dynamo_captures_them(name):
    eager = LAYERS[name]()
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model, backend="ort")
    eager_opt = torch.optim.SGD(eager.parameters(), lr=0.1)
    ort_opt = torch.optim.SGD(compiled_model.parameters(), lr=0.1)
    x = torch.randn(3, 5, 6)  # data: needs no gradient, as a batch does
    with torch._dynamo.config.patch(allow_rnn=True):
        for _ in range(2):
            expected = eager(x).pow(2).mean()
            got = compiled(x).pow(2).mean()
            expected.backward()
            got.backward()
            torch.testing.assert_close(got, expected)
            for (param, p_eager), p_ort in zip(eager.named_parameters(), compiled_model.parameters()):
                torch.testing.assert_close(p_ort.grad, p_eager.grad, msg=f"{name}: gradient of {param}")
            eager_opt.step()
            ort_opt.step()
            eager_opt.zero_grad()
            ort_opt.zero_grad()
    report = ort_dynamo.report()
    assert report.ort_nodes > 0 and report.fallback_nodes == 0, str(report)
    assert not report.graph_breaks, report.graph_breaks
    assert torch._C._get_mkldnn_enabled(), "oneDNN must be switched back on after tracing"


def test_a_recurrent_cell_trains_on_ort_without_dynamos_switch():
    """nn.LSTMCell and nn.GRUCell are not what allow_rnn guards: Dynamo captures them as is."""

    class Cells(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lstm = nn.LSTMCell(6, 8)
            self.gru = nn.GRUCell(8, 8)

        def forward(self, x):
            h, _ = self.lstm(x)
            return self.gru(h)

    eager = Cells()
    compiled_model = copy.deepcopy(eager)
    x = torch.randn(4, 6)
    expected = eager(x).sum()
    got = torch.compile(compiled_model, backend="ort")(x).sum()
    expected.backward()
    got.backward()
    torch.testing.assert_close(got, expected)
    for p_eager, p_ort in zip(eager.parameters(), compiled_model.parameters()):
        torch.testing.assert_close(p_ort.grad, p_eager.grad)
    assert ort_dynamo.report().fallback_nodes == 0 and ort_dynamo.report().ort_nodes > 0


def test_without_dynamos_switch_the_report_says_the_lstm_ran_in_pytorch_and_how_to_compile_it():
    model = LAYERS["lstm"]()
    x = torch.randn(3, 5, 6)
    torch.testing.assert_close(torch.compile(model, backend="ort")(x), model(x))
    report = ort_dynamo.report()
    assert report.ort_nodes == 0  # Dynamo gave the whole frame up: nothing reached ORT
    assert any("LSTM" in reason for reason in report.graph_breaks), report.graph_breaks
    assert "allow_rnn" in str(report), str(report)  # Dynamo's hint is printed with the reason


@pytest.mark.parametrize("dynamic", [False, True])
def test_a_loop_over_time_steps_gets_its_gradients_as_one_copy_and_one_product(monkeypatch, dynamic):
    """``x[:, t]`` for every step: x's gradient is the steps' gradients stacked (not a sum of a
    full-size Where per step, quadratic in the steps), and the shared weight's gradient one
    product over all steps (not a thin product per step and their sum). Under ``dynamic=True``
    too, whose symbolic batch kept both (layer_ops --dynamic lstm_64: 3.4x eager)."""
    from ort_dynamo import lower

    replaced = []
    original = lower.stacked_row_gradients

    def spy(gm):
        replaced.append(original(gm))
        return replaced[-1]

    monkeypatch.setattr(lower, "stacked_row_gradients", spy)

    def recurrence(x, w_in, w_rec):
        h = torch.zeros(x.shape[0], w_rec.shape[0])
        steps = []
        for t in range(x.shape[1]):
            h = torch.tanh(x[:, t] @ w_in + h @ w_rec)
            steps.append(h)
        return torch.stack(steps, 1) + x.mean(-1, keepdim=True)  # x read whole too: a term besides the rows

    x = torch.randn(4, 8, 16, requires_grad=True)
    w_in = torch.randn(16, 32, requires_grad=True)
    w_rec = (torch.randn(32, 32) / 8).requires_grad_()
    out = torch.compile(recurrence, backend="ort", dynamic=dynamic)(x, w_in, w_rec)
    out.square().sum().backward()
    leaves = [t.detach().clone().requires_grad_() for t in (x, w_in, w_rec)]
    recurrence(*leaves).square().sum().backward()
    for got, expected in zip((x, w_in, w_rec), leaves):
        torch.testing.assert_close(got.grad, expected.grad, rtol=1e-4, atol=1e-5)
    # forward: nothing; backward: x's rows stacked, and both weights' products joined
    assert replaced == [0, 3], replaced
    assert ort_dynamo.report().fallback_nodes == 0


def test_an_lstms_sums_over_unit_dims_go_and_its_bias_gradients_are_one_sum_each(monkeypatch):
    """An unrolled LSTM's backward sums each step's gates over a dim of size 1 (a no-op ORT ran
    as a ReduceSum pass, 128 of them at 64 steps and 2 layers) and sums each bias's gradient per
    step and then over the steps (a small ReduceSum per step and a T-way sum). The first are
    gone; the second are one sum over the steps' rows stacked. Eager's gradients."""
    from ort_dynamo import lower

    removed, joined = [], []
    original_unit, original_join = lower.unit_sums_removed, lower._join_row_sums

    def unit_spy(gm):
        removed.append(original_unit(gm))
        return removed[-1]

    def join_spy(*args):
        joined.append(original_join(*args))
        return joined[-1]

    monkeypatch.setattr(lower, "unit_sums_removed", unit_spy)
    monkeypatch.setattr(lower, "_join_row_sums", join_spy)
    eager = Tagger(nn.LSTM(6, 8, batch_first=True), 8)
    compiled_model = copy.deepcopy(eager)
    x = torch.randn(3, 6, 6)
    with torch._dynamo.config.patch(allow_rnn=True):
        torch.compile(compiled_model, backend="ort")(x).pow(2).mean().backward()
    eager(x).pow(2).mean().backward()
    for (name, p_eager), p_ort in zip(eager.named_parameters(), compiled_model.parameters()):
        torch.testing.assert_close(p_ort.grad, p_eager.grad, msg=name)
    assert sum(removed) >= 6, removed  # one per step at least, in the backward
    assert joined.count(True) >= 1, joined
    assert ort_dynamo.report().fallback_nodes == 0


def test_a_sum_over_unit_dims_becomes_the_tensor_or_its_squeeze():
    from torch.fx.experimental.proxy_tensor import make_fx

    from ort_dynamo import lower

    def fn(x, y):
        return x.sum([0, 2]) * 2, y.sum(0, keepdim=True) + 1, y.sum(1)  # the last is a real sum

    x, y = torch.randn(1, 3, 1), torch.randn(1, 4)
    gm = make_fx(fn, tracing_mode="fake")(x, y)
    assert lower.unit_sums_removed(gm) == 2
    sums = [n for n in gm.graph.nodes if n.op == "call_function" and "sum" in str(n.target)]
    assert len(sums) == 1, gm.graph
    for got, want in zip(gm(x, y), fn(x, y)):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want)
