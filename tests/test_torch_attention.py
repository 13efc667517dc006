"""Option cpu_torch_attention: on CPU, PyTorch's flash attention runs inside the ORT session as a
custom op that calls torch's own kernel (csrc/torch_attention.c), forward and backward, with
eager's values; attention it cannot take stays ORT's, written out."""

import glob

import onnx
import pytest
import torch
import torch.nn.functional as F

import ort_dynamo
from ort_dynamo import _torch_attention
from parity import assert_all_on_ort, assert_same_training, train_both

pytestmark = pytest.mark.skipif(bool(_torch_attention.problem()), reason=_torch_attention.problem() or "")

OPTIONS = {"cpu_torch_attention": True, "fallback_policy": "DISABLE"}


def _ops_run(save_path) -> set[str]:
    """The op types of every model the compile saved."""
    return {node.op_type for path in glob.glob(f"{save_path}/*.onnx") for node in onnx.load(path).graph.node}


def _forward_and_gradients(fn, inputs, options=None):
    args = [t.clone().requires_grad_(t.is_floating_point()) for t in inputs]
    compiled = torch.compile(fn, backend="ort", options=options) if options is not None else fn
    out = compiled(*args)
    out.square().sum().backward()
    return out.detach(), [a.grad for a in args if a.requires_grad]


MASKS = {
    "none": None,
    "additive": torch.where(torch.rand(2, 1, 1, 8) > 0.3, 0.0, float("-inf")).index_fill(3, torch.tensor([0]), 0.0),
    "boolean": torch.ones(8, 8, dtype=torch.bool).tril(),
}


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("is_causal, scale", [(False, None), (True, None), (False, 0.3)])
def test_attention_inside_ort_gives_eagers_values_and_gradients(tmp_path, mask, is_causal, scale):
    if mask != "none" and is_causal:
        pytest.skip("SDPA refuses a mask together with is_causal")
    q, k, v = (torch.randn(2, 3, 8, 16) for _ in range(3))

    def attention(q, k, v):
        return F.scaled_dot_product_attention(q * 1.5, k, v, attn_mask=MASKS[mask], is_causal=is_causal,
                                              scale=scale)

    ort_dynamo.reset()
    torch._dynamo.reset()
    got, got_grads = _forward_and_gradients(attention, (q, k, v), {**OPTIONS, "save_onnx": True,
                                                                   "save_path": str(tmp_path)})
    want, want_grads = _forward_and_gradients(attention, (q, k, v))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert {"FlashAttentionCpu", "FlashAttentionCpuGrad"} <= _ops_run(tmp_path)
    assert_all_on_ort()
    # One partition per graph, forward and backward: attention splits nothing.
    assert [g.partitions for g in ort_dynamo.report().graphs] == [1, 1]


def test_attention_with_dropout_stays_written_out_on_ort(tmp_path):
    q = torch.randn(2, 3, 8, 16, requires_grad=True)
    torch.manual_seed(0)
    ort_dynamo.reset()
    torch._dynamo.reset()
    fn = torch.compile(lambda q: F.scaled_dot_product_attention(q, q, q, dropout_p=0.5).sum(), backend="ort",
                       options={**OPTIONS, "save_onnx": True, "save_path": str(tmp_path)})
    fn(q).backward()
    assert "FlashAttentionCpu" not in _ops_run(tmp_path)
    assert_all_on_ort()


def test_without_its_library_attention_stays_ort_s_and_a_warning_says_why(monkeypatch, tmp_path):
    monkeypatch.setattr(_torch_attention, "problem", lambda: "no C compiler (a test's stand-in)")
    q = torch.randn(2, 3, 8, 16, requires_grad=True)
    ort_dynamo.reset()  # also re-arms the once-per-cause warnings
    torch._dynamo.reset()
    fn = torch.compile(lambda q: F.scaled_dot_product_attention(q, q, q).sum(), backend="ort",
                       options={**OPTIONS, "save_onnx": True, "save_path": str(tmp_path)})
    with pytest.warns(UserWarning, match="attention runs on ORT written out instead: no C compiler"):
        fn(q).backward()
    assert "FlashAttentionCpu" not in _ops_run(tmp_path)
    assert_all_on_ort()


@pytest.mark.parametrize("kind", ["gpt2", "bert", "llama"])
def test_hf_models_train_like_eager_with_torchs_attention_inside_ort(kind):
    from test_train_parity import _tiny_hf

    model = _tiny_hf(kind, "sdpa")
    ids = torch.randint(0, 64, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 9:] = 0
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids}
    ort_dynamo.reset()
    result = train_both(model, lambda: batch, lambda out: out.loss, options={"cpu_torch_attention": True})
    assert_same_training(*result, rtol=1e-5, atol=1e-5)
    assert_all_on_ort()


def test_new_lengths_reuse_the_exported_attention_with_eagers_values():
    def attention(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    ort_dynamo.reset()
    torch._dynamo.reset()
    compiled = torch.compile(attention, backend="ort", dynamic=True, options={**OPTIONS, "memory_opt_level": 0})
    for length in (8, 13, 21):
        q, k, v = (torch.randn(2, 3, length, 16) for _ in range(3))
        got, got_grads = _forward_and_gradients(compiled, (q, k, v))
        want, want_grads = _forward_and_gradients(attention, (q, k, v))
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        for a, b in zip(got_grads, want_grads):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert ort_dynamo.report().exports == 2  # the forward and the backward graph, once each
    assert_all_on_ort()
