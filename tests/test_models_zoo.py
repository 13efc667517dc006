"""Tiny transformers models (random weights, nothing downloaded) train on ORT like eager.

Each model takes 3 SGD steps (lr 0.1) eagerly and through ``torch.compile(backend="ort")``
from the same initial weights. Losses must agree to rtol 1e-5; gradients and updated
parameters to rtol 1e-4 / atol 1e-6: ORT fuses and reorders float32 reductions (LayerNorm,
Softmax, MatMul+Add), which moves the last bits, and 3 steps compound that. SGD rather than
Adam: Adam divides by sqrt(v), amplifying rounding noise in parameters whose true gradient
is ~0 (attention key biases, which softmax is invariant to).
"""

from __future__ import annotations

import copy

import pytest
import torch

import ort_dynamo

transformers = pytest.importorskip("transformers")

STEPS = 3
LOSS_RTOL = 1e-5
GRAD_TOL = dict(rtol=1e-4, atol=1e-6)


def train(model: torch.nn.Module, batches, loss_fn, compile_: bool):
    """3 SGD steps; returns the losses and the gradients of the last step."""
    step_model = torch.compile(model, backend="ort", dynamic=False) if compile_ else model
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    grads = {}
    for batch in batches:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(step_model, batch)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        losses.append(loss.item())
    return losses, grads


def assert_trains_like_eager(model: torch.nn.Module, batch, loss_fn) -> None:
    """3 steps on one batch (so the loss must drop), eager vs ORT from the same weights."""
    batches = [batch] * STEPS
    eager_model = copy.deepcopy(model)
    ort_model = copy.deepcopy(model)
    eager_losses, eager_grads = train(eager_model, batches, loss_fn, compile_=False)
    ort_losses, ort_grads = train(ort_model, batches, loss_fn, compile_=True)

    report = ort_dynamo.report()
    assert report.ort_nodes > 0, "nothing ran on ORT"
    assert report.fallback_nodes == 0, "\n".join(str(f) for f in report.fallbacks)
    torch.testing.assert_close(torch.tensor(ort_losses), torch.tensor(eager_losses), rtol=LOSS_RTOL, atol=0)
    assert eager_losses[-1] < eager_losses[0], "the model should learn in 3 steps"
    assert ort_grads.keys() == eager_grads.keys()
    for name, grad in eager_grads.items():
        torch.testing.assert_close(ort_grads[name], grad, **GRAD_TOL, msg=lambda m: f"grad of {name}: {m}")
    for (name, p_ort), p_eager in zip(ort_model.named_parameters(), eager_model.parameters()):
        torch.testing.assert_close(p_ort, p_eager, **GRAD_TOL, msg=lambda m: f"param {name}: {m}")


def hf_loss(model, batch):
    return model(**batch).loss


def lm_batch(vocab: int, batch: int = 2, seq: int = 8):
    ids = torch.randint(0, vocab, (batch, seq))
    return {"input_ids": ids, "labels": ids.clone()}


def test_whisper_encoder_decoder_conv1d():
    config = transformers.WhisperConfig(
        vocab_size=64, num_mel_bins=8, d_model=32, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
        max_source_positions=8, max_target_positions=16, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
    model = transformers.WhisperForConditionalGeneration(config)
    # The encoder's two convs (the second strided) map 16 frames to max_source_positions = 8.
    batch = {"input_features": torch.randn(2, 8, 16), "labels": torch.randint(3, 64, (2, 6))}
    assert_trains_like_eager(model, batch, hf_loss)


def test_clip_contrastive_loss():
    config = transformers.CLIPConfig(
        text_config=dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, max_position_embeddings=16, dropout=0.0,
                         attention_dropout=0.0),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=16, patch_size=8, dropout=0.0, attention_dropout=0.0),
        projection_dim=16)
    model = transformers.CLIPModel(config)
    batch = {"input_ids": torch.randint(0, 64, (3, 7)), "pixel_values": torch.randn(3, 3, 16, 16),
               "return_loss": True}
    assert_trains_like_eager(model, batch, hf_loss)


def test_swin_windowed_attention_with_rolls():
    config = transformers.SwinConfig(
        image_size=16, patch_size=2, num_channels=3, embed_dim=16, depths=[2, 1], num_heads=[2, 2],
        window_size=2, mlp_ratio=2.0, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        drop_path_rate=0.0, num_labels=5)
    model = transformers.SwinForImageClassification(config)
    # depth 2 in stage 1: the second block uses shifted windows (torch.roll).
    batch = {"pixel_values": torch.randn(2, 3, 16, 16), "labels": torch.randint(0, 5, (2,))}
    assert_trains_like_eager(model, batch, hf_loss)


def test_gptj_rotary():
    config = transformers.GPTJConfig(vocab_size=64, n_positions=32, n_embd=32, n_layer=1, n_head=2,
                                     rotary_dim=8, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPTJForCausalLM(config)
    assert_trains_like_eager(model, lm_batch(64), hf_loss)


def test_mobilebert_masked_lm():
    config = transformers.MobileBertConfig(
        vocab_size=64, hidden_size=32, embedding_size=16, true_hidden_size=16, intra_bottleneck_size=16,
        num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, num_feedforward_networks=1,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, max_position_embeddings=32)
    model = transformers.MobileBertForMaskedLM(config)
    ids = torch.randint(0, 64, (2, 8))
    labels = torch.full_like(ids, -100)
    labels[:, ::3] = ids[:, ::3]  # only masked positions count (ignore_index -100 elsewhere)
    batch = {"input_ids": ids, "labels": labels}
    assert_trains_like_eager(model, batch, hf_loss)


class MixtureOfExperts(torch.nn.Module):
    """Top-k routed experts; tokens scattered back with index_add (as in Mixtral-style MoE)."""

    def __init__(self, dim: int = 32, experts: int = 4, top_k: int = 2) -> None:
        super().__init__()
        self.top_k = top_k
        self.router = torch.nn.Linear(dim, experts, bias=False)
        self.experts = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(dim, 2 * dim), torch.nn.GELU(), torch.nn.Linear(2 * dim, dim))
            for _ in range(experts))
        self.head = torch.nn.Linear(dim, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        weights, chosen = torch.topk(torch.softmax(self.router(tokens), dim=-1), self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        # One row per (token, choice), grouped by expert as a dispatcher would.
        expert_of = chosen.reshape(-1)
        token_of = torch.arange(tokens.shape[0]).repeat_interleave(self.top_k)
        order = torch.argsort(expert_of, stable=True)
        expert_of, token_of, weight_of = expert_of[order], token_of[order], weights.reshape(-1)[order]
        # Every expert runs on every token (static shapes: no nonzero(), no graph break);
        # each routed row picks its expert's output.
        every = torch.stack([expert(tokens) for expert in self.experts])
        routed = every[expert_of, token_of] * weight_of[:, None]
        out = torch.zeros_like(tokens).index_add(0, token_of, routed)
        return self.head(out + tokens).reshape(*x.shape[:-1], -1)


def test_mixture_of_experts_topk_index_add():
    model = MixtureOfExperts()
    batch = (torch.randn(2, 5, 32), torch.randint(0, 8, (2, 5)))

    def loss_fn(m, batch):
        x, y = batch
        return torch.nn.functional.cross_entropy(m(x).reshape(-1, 8), y.reshape(-1))

    assert_trains_like_eager(model, batch, loss_fn)
