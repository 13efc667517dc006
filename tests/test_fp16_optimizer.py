"""FP16_Optimizer: loss scaling, overflow skipping and grad clipping in one ORT graph per step."""

import copy

import pytest
import torch

from ort_dynamo.optim import AdamWMode, FP16_Optimizer, FusedAdam


def mlp(dtype=torch.float32) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)).to(dtype)


def batch(step: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 16, generator=g).to(dtype), torch.randn(8, 4, generator=g)


def loss_of(model, step, dtype=torch.float32):
    x, y = batch(step, dtype)
    return torch.nn.functional.mse_loss(model(x).float(), y)


@pytest.mark.parametrize("max_norm", [0.05, 100.0])
def test_unscale_and_clip_match_clip_grad_norm(max_norm):
    model = mlp()
    ref_model = copy.deepcopy(model)
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), init_scale=2.0 ** 10, max_grad_norm=max_norm)
    ref = torch.optim.SGD(ref_model.parameters(), lr=0.1)
    for step in range(3):
        opt.zero_grad()
        opt.backward(loss_of(model, step))
        ref.zero_grad()
        loss_of(ref_model, step).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), max_norm)
        opt.step()
        ref.step()
        assert opt.grad_norm == pytest.approx(ref_norm.item(), rel=1e-6)
        for p, q in zip(model.parameters(), ref_model.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-9)
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-8)
    clipped = max_norm < ref_norm.item()
    assert clipped == (max_norm == 0.05)  # one run clips, the other does not
    assert opt.ort_runs == 3 and opt.graphs_built == 1 and opt.skipped_steps == 0


def test_injected_inf_skips_step_and_halves_scale():
    model = mlp()
    inner = torch.optim.Adam(model.parameters(), lr=0.1)
    opt = FP16_Optimizer(inner, init_scale=2.0 ** 16)
    before = [p.detach().clone() for p in model.parameters()]
    opt.backward(loss_of(model, 0))
    model[0].weight.grad[3, 5] = float("inf")
    opt.step()
    assert opt.overflow and opt.skipped_steps == 1
    assert opt.loss_scale == 2.0 ** 15
    assert not inner.state  # the inner optimizer never stepped
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    # NaN counts as overflow too; a clean step then updates and keeps the scale.
    opt.zero_grad()
    opt.backward(loss_of(model, 1))
    model[2].bias.grad[0] = float("nan")
    opt.step()
    assert opt.loss_scale == 2.0 ** 14
    opt.zero_grad()
    opt.backward(loss_of(model, 2))
    opt.step()
    assert not opt.overflow and opt.loss_scale == 2.0 ** 14
    assert not torch.equal(model[0].weight, before[0])


def test_healthy_run_grows_scale_after_growth_interval():
    model = mlp()
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.01), init_scale=256.0, growth_interval=3)
    for step in range(7):
        opt.zero_grad()
        opt.backward(loss_of(model, step))
        opt.step()
    assert opt.loss_scale == 256.0 * 2 * 2 and opt.growth_tracker == 1


def test_overflow_at_min_scale_raises_or_holds():
    model = mlp()
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.01), init_scale=4.0, min_scale=2.0)
    for expected in (2.0,):
        opt.backward(loss_of(model, 0))
        model[0].bias.grad[0] = float("inf")
        opt.step()
        assert opt.loss_scale == expected
    opt.zero_grad()
    opt.backward(loss_of(model, 0))
    model[0].bias.grad[0] = float("inf")
    with pytest.raises(FloatingPointError, match="Current loss scale already at minimum"):
        opt.step()
    holding = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.01), init_scale=2.0, min_scale=2.0,
                             raise_at_min_scale=False)
    holding.step()
    assert holding.overflow and holding.loss_scale == 2.0


def test_fp16_model_with_fused_adam_and_master_weights_matches_fp32_reference():
    model = mlp(torch.float16)
    masters_ref = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    inner = FusedAdam(model.parameters(), lr=1e-2, eps=1e-8, weight_decay=0.01, adam_w_mode=AdamWMode.ADAMW_TORCH)
    opt = FP16_Optimizer(inner, init_scale=2.0 ** 12, master_weights=True, max_grad_norm=1.0)
    ref = torch.optim.AdamW(masters_ref, lr=1e-2, eps=1e-8, weight_decay=0.01)
    losses = []
    for step in range(20):
        opt.zero_grad()
        loss = loss_of(model, step % 4, torch.float16)
        losses.append(loss.item())
        opt.backward(loss)
        # Reference: the same fp16 grads, unscaled and clipped in fp32, then torch's AdamW.
        for p, m in zip(model.parameters(), masters_ref):
            m.grad = p.grad.float() / opt.loss_scale
        torch.nn.utils.clip_grad_norm_(masters_ref, 1.0)
        opt.step()
        ref.step()
        assert not opt.overflow
    for p, m, m_ref in zip(model.parameters(), opt.master_params, masters_ref):
        assert p.dtype == torch.float16 and m.dtype == torch.float32
        torch.testing.assert_close(m, m_ref, rtol=1e-5, atol=1e-6)
        assert torch.equal(p, m.half())
    assert losses[-1] < losses[0]
    assert opt.ort_runs == 20 and inner.ort_runs == 20 and opt.graphs_built == 1 and inner.graphs_built == 1


def test_state_dict_carries_scaler_state():
    model = mlp()
    opt = FP16_Optimizer(torch.optim.AdamW(model.parameters()), init_scale=64.0, growth_interval=2)
    for step in range(3):
        opt.zero_grad()
        opt.backward(loss_of(model, step))
        opt.step()
    saved = opt.state_dict()
    assert saved["loss_scaler"]["loss_scale"] == 128.0 and saved["loss_scaler"]["growth_tracker"] == 1
    other = FP16_Optimizer(torch.optim.AdamW(copy.deepcopy(model).parameters()))
    other.load_state_dict(saved)
    assert other.loss_scale == 128.0 and other.growth_tracker == 1 and other.growth_interval == 2
    assert float(other.optimizer.state_dict()["state"][0]["step"]) == 3
    with pytest.raises(ValueError, match="loss_scaler"):
        other.load_state_dict({"optimizer": saved["optimizer"]})


def test_bad_arguments_are_rejected():
    p = torch.nn.Parameter(torch.ones(2))
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        FP16_Optimizer(object())
    with pytest.raises(ValueError, match="backoff_factor"):
        FP16_Optimizer(torch.optim.SGD([p], lr=1), backoff_factor=2.0)
    with pytest.raises(ValueError, match="min_scale"):
        FP16_Optimizer(torch.optim.SGD([p], lr=1), init_scale=1.0, min_scale=2.0)
