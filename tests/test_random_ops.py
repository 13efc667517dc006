"""Random ops run on ORT with ORT's own RNG: masks differ from eager's, statistics do not.

Dropout, bernoulli and rand-like ops are lowered to ONNX random ops, so ``torch.manual_seed``
does not reproduce eager's exact mask. What must hold, and is tested here statistically on
10^5 draws (bounds are > 6 standard deviations wide, so the tests are not flaky):
keep rate, 1/(1-p) scaling, the backward reusing the forward's mask, and fresh draws per call.
"""

from __future__ import annotations

import pytest
import torch

import ort_dynamo

N = (200, 500)  # 10^5 draws: std of a rate estimate <= 0.0016


def compiled(fn):
    return torch.compile(fn, backend="ort", dynamic=False, options={"fallback_policy": "DISABLE"})


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
