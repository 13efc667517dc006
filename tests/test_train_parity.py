"""3 training steps under backend="ort" match eager, with nothing left in PyTorch."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ort_dynamo
from parity import assert_all_on_ort, assert_same_training, train_both


def test_mlp_trains_like_eager():
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Dropout(0.0), nn.Linear(32, 4))
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    result = train_both(model, lambda: (x,), lambda out: F.cross_entropy(out, y))
    assert_same_training(*result)
    assert_all_on_ort()
    kinds = sorted(g.kind for g in ort_dynamo.report().graphs)
    assert kinds == ["backward", "forward"]


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, stride=2, groups=2)
        self.bn2 = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.relu(self.bn2(self.conv2(x)))
        return self.head(F.adaptive_avg_pool2d(x, 1).flatten(1))


def test_cnn_with_batchnorm_trains_like_eager_and_updates_running_stats():
    model = SmallCNN().train()
    x, y = torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))
    eager, compiled, losses_e, losses_o = train_both(model, lambda: (x,), lambda out: F.cross_entropy(out, y))
    assert_same_training(eager, compiled, losses_e, losses_o)  # buffers: running mean/var, batch count
    assert compiled.bn1.num_batches_tracked.item() == 3
    assert not torch.equal(compiled.bn1.running_mean, torch.zeros(8))
    assert_all_on_ort()


def _tiny_hf(kind: str, attn: str):
    transformers = pytest.importorskip("transformers")
    if kind == "gpt2":
        cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=32,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                      bos_token_id=0, eos_token_id=0)
        model = transformers.GPT2LMHeadModel(cfg)
    elif kind == "bert":
        cfg = transformers.BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                      intermediate_size=64, vocab_size=64, max_position_embeddings=32,
                                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        model = transformers.BertForMaskedLM(cfg)
    else:
        cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                       num_key_value_heads=2, intermediate_size=64, vocab_size=64,
                                       max_position_embeddings=32)
        model = transformers.LlamaForCausalLM(cfg)
    model.config._attn_implementation = attn
    return model.train()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("kind", ["gpt2", "bert", "llama"])
def test_hf_model_trains_like_eager(kind, attn):
    model = _tiny_hf(kind, attn)
    ids = torch.randint(0, 64, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 9:] = 0  # padding: exercises the additive attention mask
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids}
    result = train_both(model, lambda: batch, lambda out: out.loss)
    assert_same_training(*result, rtol=1e-5, atol=1e-5)
    assert_all_on_ort()


def test_sdpa_variants_match_eager_forward_and_backward():
    """Causal, additive mask, boolean mask and GQA all run on ORT (no flash-attention kernel)."""
    q = torch.randn(2, 4, 6, 8)
    kv = torch.randn(2, 2, 6, 8)
    additive = torch.randn(2, 1, 6, 6)
    boolean = torch.rand(6, 6) > 0.3
    boolean.fill_diagonal_(True)
    cases = {
        "causal": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        "additive": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=additive),
        "boolean": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=boolean),
        "gqa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True, scale=0.3),
    }
    for name, fn in cases.items():
        ort_dynamo.reset()
        k = kv if name == "gqa" else q
        args_e = [t.clone().requires_grad_() for t in (q, k, k * 0.5)]
        args_o = [t.clone().requires_grad_() for t in (q, k, k * 0.5)]
        out_e, out_o = fn(*args_e), torch.compile(fn, backend="ort")(*args_o)
        torch.testing.assert_close(out_o, out_e, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
        out_e.square().sum().backward()
        out_o.square().sum().backward()
        for a_e, a_o in zip(args_e, args_o):
            torch.testing.assert_close(a_o.grad, a_e.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
        assert_all_on_ort()


@pytest.mark.parametrize("level", [0, 1])
def test_transformer_layers_with_padding_train_like_eager_on_ort(level):
    """nn.MultiheadAttention reaches SDPA inside a function Dynamo keeps whole, so CPU's
    flash-attention op reached AOTAutograd. torchlib lowers it with a logsumexp of zeros, which
    its backward (then in PyTorch) read: every attention gradient was wrong. Now the attention
    is written out as F.scaled_dot_product_attention's is, on ORT, and a sequence padded whole
    gives eager's zeros, not NaN."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    x, weights = torch.randn(3, 10, 32), torch.randn(3, 10, 32)
    pad = torch.zeros(3, 10, dtype=torch.bool)
    pad[1, 6:] = True
    pad[2] = True
    ort_dynamo.reset()
    eager = copy.deepcopy(layer)
    compiled = torch.compile(copy.deepcopy(layer), backend="ort", options={"memory_opt_level": level})
    outs = []
    for net in (eager, compiled):
        out = net(x, src_key_padding_mask=pad)
        (out * weights).sum().backward()
        outs.append(out.detach())
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    for (name, want), got in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=1e-5 * want.grad.abs().max().item(), msg=name)
    assert_all_on_ort()


def test_multihead_attention_is_written_out_before_tracing_whatever_the_device():
    """Dynamo keeps F.multi_head_attention_forward whole; lower_graph swaps it for a version
    whose SDPA is ours, so no device's flash kernel reaches the graph (CUDA's would run in
    PyTorch: torchlib fakes their logsumexp)."""
    from ort_dynamo import lower

    targets = []

    def inspect(gm, example_inputs):
        lower.lower_graph(gm, recompute_attention=True)
        targets.extend(n.target for n in gm.graph.nodes if n.op == "call_function")
        return gm

    mha = nn.MultiheadAttention(16, 2)
    x = torch.randn(5, 2, 16)
    torch.compile(mha, backend=inspect)(x, x, x, need_weights=False)
    assert lower.multi_head_attention_recomputed in targets, targets
    assert F.multi_head_attention_forward not in targets


@pytest.mark.parametrize("case", ["plain", "causal", "gqa", "float_mask", "bfloat16"])
def test_cpu_flash_attention_op_trains_like_eager(case):
    """The op itself, as code that calls it (or keeps its caller whole) gives it: its outputs,
    the logsumexp included, and its gradients are eager's, on ORT."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    dtype = torch.bfloat16 if case == "bfloat16" else torch.float32
    q = torch.randn(2, 4, 12, 8, dtype=dtype)
    kv = torch.randn(2, 2 if case == "gqa" else 4, 16 if case == "causal" else 12, 8, dtype=dtype)
    mask = None
    if case == "float_mask":
        mask = torch.randn(2, 1, 12, 12).masked_fill(torch.rand(2, 1, 12, 12) > 0.7, float("-inf"))
        mask[0, 0, 3] = float("-inf")  # a row masked whole: zeros and a logsumexp of 0

    def attend(q, k, v):
        return flash(q, k, v, 0.0, case == "causal", attn_mask=mask, scale=0.3)

    ort_dynamo.reset()
    results = []
    for fn in (attend, torch.compile(attend, backend="ort")):
        args = [t.clone().requires_grad_() for t in (q, kv, kv * 0.5)]
        out, logsumexp = fn(*args)
        out.float().sin().sum().backward()
        results.append([out.detach(), logsumexp.detach(), *(a.grad for a in args)])
    tolerance = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    for name, got, want in zip(["out", "logsumexp", "grad q", "grad k", "grad v"], results[1], results[0]):
        torch.testing.assert_close(got, want, **tolerance, msg=name)
    assert_all_on_ort()


@pytest.mark.parametrize("opset", [20, 23])
def test_newer_opsets_train_like_eager_with_nothing_in_pytorch(opset):
    """torchlib's functions are written for opset 18; newer model opsets must still export."""
    model = _tiny_hf("gpt2", "sdpa")
    ids = torch.randint(0, 64, (2, 12))
    result = train_both(model, lambda: {"input_ids": ids, "labels": ids}, lambda out: out.loss,
                        options={"opset": opset})
    assert_same_training(*result, rtol=1e-5, atol=1e-5)
    assert_all_on_ort()


def test_dynamic_batch_and_sequence_length_do_not_reexport_a_transformer():
    model = _tiny_hf("gpt2", "sdpa")
    compiled = torch.compile(model, backend="ort", dynamic=True)
    exports = []
    for batch, length in ((2, 8), (3, 12), (4, 5), (2, 16)):
        ids = torch.randint(0, 64, (batch, length))
        loss = compiled(input_ids=ids, labels=ids).loss
        torch.testing.assert_close(loss, model(input_ids=ids, labels=ids).loss, rtol=1e-5, atol=1e-6)
        loss.backward()
        exports.append(ort_dynamo.report().exports)
    # Shapes stay symbolic: what the first step exported serves every later shape. (More than
    # one forward/backward pair: transformers' logging call is a Dynamo graph break.)
    assert exports == [exports[0]] * 4, exports
    assert ort_dynamo.report().fallback_nodes == 0
    # Sizes come from the inputs, not from tensors ORT computes: one ORT run per forward.
    assert [g.partitions for g in ort_dynamo.report().graphs if g.kind == "forward"] == [1, 1]


class _PatchEmbedding(nn.Module):
    """SegFormer's and PVT's stem: a strided convolution, its pixels as tokens, then a map again."""

    def __init__(self):
        super().__init__()
        self.conv, self.norm, self.bn = nn.Conv2d(3, 8, 7, stride=4, padding=3), nn.LayerNorm(8), nn.BatchNorm2d(8)

    def forward(self, image):
        x = self.conv(image)
        batch, channels, height, width = x.shape
        tokens = self.norm(x.flatten(2).transpose(1, 2))
        return self.bn(tokens.transpose(1, 2).reshape(batch, channels, height, width)).square().mean()


def test_sizes_of_strided_windows_come_from_the_inputs_and_keep_a_dynamic_forward_in_one_run():
    # (s - 1) // 4 + 1 and BatchNorm's element count were read off the convolution's output:
    # the forward ran as three ORT partitions, the shape arithmetic in Python between them.
    torch.manual_seed(0)
    sizes = iter([32, 37, 45])
    result = train_both(_PatchEmbedding(), lambda: (torch.randn(2, 3, *[next(sizes)] * 2),), lambda loss: loss,
                        dynamic=True)
    assert_same_training(*result, rtol=1e-4, atol=1e-5)
    assert_all_on_ort()
    forward = [g for g in ort_dynamo.report().graphs if g.kind == "forward"]
    assert len(forward) == 1 and forward[0].partitions == 1, ort_dynamo.report()
