"""Random draws: on CPU they come from PyTorch's generator, eager's own draws; ORT's draw
from a generator of their own, and must still have the right statistics.

By default (option ``torch_random``) every random draw of a CPU forward graph runs in PyTorch,
so ``torch.manual_seed`` and ``get_rng_state``/``set_rng_state`` reproduce it and dropout's
masks are eager's, bit for bit, while the arithmetic around them stays on ORT. With
``torch_random=False`` (and on CUDA) dropout, bernoulli and rand-like ops are lowered to ONNX
random ops, which ``torch.manual_seed`` does not reach. What must hold for those, tested
statistically on 10^5 draws (bounds are > 6 standard deviations wide, so the tests are not
flaky): keep rate, 1/(1-p) scaling, the backward reusing the forward's mask, fresh draws per call.
"""

from __future__ import annotations

import copy

import pytest
import torch

import ort_dynamo

N = (200, 500)  # 10^5 draws: std of a rate estimate <= 0.0016


def compiled(fn):
    """ORT's own random ops (what CUDA runs), not PyTorch's draws."""
    return torch.compile(fn, backend="ort", dynamic=False,
                         options={"fallback_policy": "DISABLE", "torch_random": False})


def seeded(seed, fn, *args):
    torch.manual_seed(seed)
    return fn(*args)


def assert_one_ort_partition_and_draws_kept(draws_per_graph: int):
    """The draws run in PyTorch before the graph's one ORT partition: they do not split it."""
    report = ort_dynamo.report()
    forward = [g for g in report.graphs if g.kind != "backward"]
    assert report.fallback_nodes == 0 and report.ort_nodes > 0
    assert [g.partitions for g in forward] == [1] * len(forward)
    assert report.kept_nodes == draws_per_graph * len(forward)
    assert all("PyTorch's generator" in kept.reason for g in report.graphs for kept in g.kept)


@pytest.mark.parametrize("dynamic", [False, True])
def test_dropout_masks_are_eagers_own_under_the_same_seed(dynamic):
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Dropout(0.3), torch.nn.GELU(),
                                torch.nn.Linear(64, 8), torch.nn.Dropout(0.1))
    compiled_model = copy.deepcopy(model)
    step = torch.compile(compiled_model, backend="ort", dynamic=dynamic)
    for batch in (16, 24):
        x = torch.randn(batch, 32)
        eager_out, ort_out = seeded(batch, model, x), seeded(batch, step, x)
        assert torch.equal(eager_out == 0, ort_out == 0)  # the same dropped places
        torch.testing.assert_close(ort_out, eager_out)
        eager_out.square().sum().backward()
        ort_out.square().sum().backward()
    for p_eager, p_ort in zip(model.parameters(), compiled_model.parameters()):
        torch.testing.assert_close(p_ort.grad, p_eager.grad)
    assert_one_ort_partition_and_draws_kept(2)


@pytest.mark.parametrize("dynamic", [False, True])
def test_draws_of_transposed_and_channels_last_tensors_are_eagers_own(dynamic):
    """Eager fills a draw's tensor in its memory order (``empty_like`` keeps the input's):
    dropout after a transpose (TransformerEncoderLayer's first dropout), dropout of a
    channels-last convolution, ``rand_like`` of a transposed tensor."""
    conv = torch.nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)

    def fn(w, image):
        t = w.t() * 2.0
        dropped = torch.nn.functional.dropout(t, 0.5, training=True)
        noise = torch.rand_like(t)
        return dropped * noise, torch.nn.functional.dropout(conv(image), 0.4, training=True)

    step = torch.compile(fn, backend="ort", dynamic=dynamic)
    for rows in (6, 8):
        w = torch.randn(rows, 5, requires_grad=True)
        image = torch.randn(2, 3, rows, 7).to(memory_format=torch.channels_last).requires_grad_()
        eager_out, ort_out = seeded(rows, fn, w, image), seeded(rows, step, w, image)
        for expected, actual in zip(eager_out, ort_out):
            assert torch.equal(actual == 0, expected == 0)
            torch.testing.assert_close(actual, expected)
            assert actual.stride() == expected.stride()
        eager_grads = torch.autograd.grad(sum(o.square().sum() for o in eager_out), (w, image))
        ort_grads = torch.autograd.grad(sum(o.square().sum() for o in ort_out), (w, image))
        for expected, actual in zip(eager_grads, ort_grads):
            torch.testing.assert_close(actual, expected)
    assert ort_dynamo.report().fallback_nodes == 0


def test_rng_state_replays_the_draws_and_new_state_draws_anew():
    step = torch.compile(lambda t: torch.nn.functional.dropout(t * 3, 0.5, training=True) + torch.rand_like(t),
                         backend="ort")
    x = torch.ones(N)
    state = torch.get_rng_state()
    first = step(x)
    second = step(x)
    torch.set_rng_state(state)
    again = step(x)
    assert torch.equal(first, again)
    assert not torch.equal(first, second)
    assert_one_ort_partition_and_draws_kept(2)


def test_draws_that_read_values_run_in_place_and_match_eager():
    def fn(t):
        probs = torch.sigmoid(t)
        return torch.bernoulli(probs) * 2 + torch.normal(t, 0.5), torch.multinomial(probs[:5].abs() + 0.1, 3)

    x = torch.randn(100, 20)
    for expected, actual in zip(seeded(0, fn, x), seeded(0, torch.compile(fn, backend="ort"), x)):
        torch.testing.assert_close(actual, expected)
    report = ort_dynamo.report()
    assert report.fallback_nodes == 0 and report.kept_nodes == 3


def test_with_torch_random_off_ort_draws_and_torch_seed_does_not_reach_them():
    step = compiled(lambda t: torch.nn.functional.dropout(t, 0.5, training=True))
    x = torch.ones(N)
    first, second = seeded(0, step, x), seeded(0, step, x)
    assert not torch.equal(first, second)
    report = ort_dynamo.report()
    assert report.kept_nodes == 0 and report.ort_nodes > 0


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_keep_rate_scaling_and_same_mask_in_backward(p):
    x = torch.randn(N, requires_grad=True)
    y = compiled(lambda t: torch.nn.functional.dropout(t, p, training=True))(x)
    weight = torch.randn(N)
    (y * weight).sum().backward()

    kept = y != 0
    assert abs(kept.float().mean().item() - (1 - p)) < 0.01
    torch.testing.assert_close(y[kept], x.detach()[kept] / (1 - p))
    # The backward must scale by the very mask the forward drew (saved, not re-drawn).
    torch.testing.assert_close(x.grad, weight * kept / (1 - p))
    report = ort_dynamo.report()
    assert report.fallback_nodes == 0 and report.ort_nodes > 0
    assert {g.kind for g in report.graphs} == {"forward", "backward"}


def test_dropout_draws_a_new_mask_every_call():
    step = compiled(lambda t: torch.nn.functional.dropout(t, 0.3, training=True))
    x = torch.ones(N)
    first, second = step(x) != 0, step(x) != 0
    # Independent masks agree where both keep or both drop: 0.7^2 + 0.3^2 = 0.58.
    agreement = (first == second).float().mean().item()
    assert abs(agreement - 0.58) < 0.01


def test_dropout_module_eval_is_identity_and_train_is_not():
    model = torch.nn.Sequential(torch.nn.Linear(50, 50), torch.nn.Dropout(0.5))
    step = compiled(model)
    x = torch.randn(64, 50)
    model.eval()
    torch.testing.assert_close(step(x), model(x))
    model.train()
    zero_rate = (step(x) == 0).float().mean().item()
    assert 0.4 < zero_rate < 0.6


def test_bernoulli_follows_per_element_probabilities():
    probs = torch.cat([torch.full((50_000,), 0.1), torch.full((50_000,), 0.8)])
    draws = compiled(torch.bernoulli)(probs)
    assert draws.dtype == probs.dtype and set(draws.unique().tolist()) <= {0.0, 1.0}
    assert abs(draws[:50_000].mean().item() - 0.1) < 0.01
    assert abs(draws[50_000:].mean().item() - 0.8) < 0.015
    assert ort_dynamo.report().ort_nodes > 0


def test_rand_like_and_randn_like_statistics():
    x = torch.empty(N)
    uniform, normal = compiled(lambda t: (torch.rand_like(t), torch.randn_like(t)))(x)
    assert uniform.shape == normal.shape == x.shape
    assert uniform.dtype == normal.dtype == torch.float32
    assert 0.0 <= uniform.min().item() and uniform.max().item() < 1.0
    assert abs(uniform.mean().item() - 0.5) < 0.01
    assert abs(normal.mean().item()) < 0.02
    assert abs(normal.std().item() - 1.0) < 0.02
    assert ort_dynamo.report().fallback_nodes == 0


class CheckpointedDropout(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Dropout(0.3), torch.nn.Linear(32, 16))
            for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = x + torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return x


def test_dropout_under_activation_checkpointing_replays_eagers_mask_and_is_reported():
    # Backward recomputes each block from the generator state forward saved: PyTorch's to replay.
    torch.manual_seed(0)
    model = CheckpointedDropout()
    compiled_model = copy.deepcopy(model)
    x = torch.randn(8, 16)
    eager_out, ort_out = seeded(3, model, x), seeded(3, torch.compile(compiled_model, backend="ort"), x)
    torch.testing.assert_close(ort_out, eager_out)
    eager_out.square().sum().backward()
    ort_out.square().sum().backward()
    for p_eager, p_ort in zip(model.parameters(), compiled_model.parameters()):
        torch.testing.assert_close(p_ort.grad, p_eager.grad, rtol=1e-5, atol=1e-5)
    report = ort_dynamo.report()
    replayed = [kept.op for g in report.graphs for kept in g.kept]
    assert report.fallback_nodes == 0 and report.ort_nodes > 0
    assert sorted(set(replayed)) == ["run_and_save_rng_state", "run_with_rng_state"], replayed
