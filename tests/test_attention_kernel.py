"""Option cpu_attention_kernel (on by default): on CPU, scaled dot-product attention runs as one
kernel of ort_dynamo's own each way (csrc/attention.h), forward and backward, with eager's
values; what it cannot take stays written out."""

import glob

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F

import ort_dynamo
from ort_dynamo import _kernels, _pointwise, _torch_attention

pytestmark = pytest.mark.skipif(not _kernels.available() or bool(_torch_attention.problem()),
                                reason="needs the kernels' compiler and torch's C shim")


def _ops_run(save_path, kind="") -> list[str]:
    """The op types of every model (of ``kind``: forward, backward) the compile saved."""
    return [node.op_type for path in sorted(glob.glob(f"{save_path}/*{kind}*.onnx"))
            for node in onnx.load(path).graph.node]


def _compiled_step(fn, inputs, tmp_path=None, options=None):
    """Outputs and input gradients of ``fn`` (eager without ``tmp_path``; else compiled, its
    kernels built before the step that is returned, its models saved under ``tmp_path``)."""
    def step(f):
        args = [t.clone().requires_grad_(t.is_floating_point()) for t in inputs]
        out = f(*args)
        (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
        return out.detach(), [a.grad for a in args if a.requires_grad]

    if tmp_path is None:
        return step(fn)
    ort_dynamo.reset()
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="ort", options={"fallback_policy": "DISABLE", "save_onnx": True,
                                                          "save_path": str(tmp_path), **(options or {})})
    step(compiled)
    ort_dynamo.wait_for_kernels()
    return step(compiled)


def _assert_like_eager(got, want):
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    for a, b in zip(got[1], want[1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-5)


CASES = {
    # (batch, heads, query length, key length, head size), mask, is_causal, scale
    "plain": ((2, 3, 8, 8, 16), None, False, None),
    "causal": ((2, 2, 70, 70, 32), None, True, None),
    "scaled": ((1, 2, 24, 24, 32), None, False, 0.3),
    # rows beyond one block of 64 and a remainder of 6, keys not a multiple of 16
    "cross, padding mask": ((2, 4, 133, 37, 64), "padding", False, None),
    # SDPA makes a bool mask additive before the flash op: the kernel's bool path is tested below
    "boolean mask": ((2, 2, 20, 20, 16), "boolean", False, None),
    "mask per head": ((2, 3, 9, 40, 48), "per head", False, None),
    "causal cross": ((1, 2, 12, 30, 16), None, True, None),
    # three blocks of rows, whose tiles of 6 each stop at their own keys (and tiles of keys start
    # at their first key's row) in the kernels' causal products
    "causal, three blocks": ((1, 3, 150, 150, 16), None, True, None),
    # the kernels leave out each row's last masked keys where those ends rise with the row (a
    # causal mask given as a mask, as HF's GPT-2 gives it), and read every key where they do not
    "causal as a float mask": ((2, 2, 150, 150, 32), "causal float", False, None),
    "ends falling with the row": ((1, 2, 70, 70, 16), "shrinking", False, None),
}


def _mask(kind, b, h, m, n):
    if kind == "padding":  # [batch, 1, 1, keys]: additive, the first key always kept
        keep = torch.rand(b, 1, 1, n) > 0.3
        keep[..., 0] = True
        return torch.where(keep, 0.0, float("-inf"))
    if kind == "boolean":
        return torch.ones(m, n, dtype=torch.bool).tril()
    if kind == "per head":
        return torch.randn(1, h, 1, n)
    if kind == "causal float":
        return torch.where(torch.ones(m, n, dtype=torch.bool).tril(), 0.0, float("-inf"))
    if kind == "shrinking":  # row r keeps keys 0..n-1-r
        return torch.where(torch.ones(m, n, dtype=torch.bool).tril().flip(0), 0.0, float("-inf"))
    return None


@pytest.mark.parametrize("case", CASES)
def test_attention_kernels_give_eagers_values_and_gradients(tmp_path, case):
    """Forward and backward are one TorchAttention kernel each, and give eager's output and
    gradients of query, key and value: masks of each type and broadcast, causal attention of
    square and cross shapes, a given scale, lengths that are not whole blocks."""
    torch.manual_seed(0)
    (b, h, m, n, d), mask_kind, is_causal, scale = CASES[case]
    mask = _mask(mask_kind, b, h, m, n)
    q, k, v = torch.randn(b, h, m, d), torch.randn(b, h, n, d), torch.randn(b, h, n, d)

    def attention(q, k, v):
        return F.scaled_dot_product_attention(q * 1.5, k, v, attn_mask=mask, is_causal=is_causal, scale=scale)

    got = _compiled_step(attention, (q, k, v), tmp_path)
    _assert_like_eager(got, _compiled_step(attention, (q, k, v)))
    for kind in ("forward", "backward"):
        ops = _ops_run(tmp_path, kind)
        assert [op.startswith("TorchAttention_") for op in ops].count(True) == 1, ops
        assert not {"FlashAttentionCpu", "FlashAttentionCpuGrad", "Softmax", "MatMul"} & set(ops), ops


def test_a_row_with_every_key_masked_is_zero_as_in_eager(tmp_path):
    q, k, v = torch.randn(1, 2, 5, 16), torch.randn(1, 2, 7, 16), torch.randn(1, 2, 7, 16)
    mask = torch.ones(5, 7, dtype=torch.bool)
    mask[2] = False

    def attention(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    got = _compiled_step(attention, (q, k, v), tmp_path)
    _assert_like_eager(got, _compiled_step(attention, (q, k, v)))
    assert torch.all(got[0][:, :, 2] == 0) and torch.all(got[1][0][:, :, 2] == 0)
    assert any(op.startswith("TorchAttention_") for op in _ops_run(tmp_path, "backward"))


@pytest.mark.parametrize("is_causal", [False, True])
def test_a_nan_in_a_query_row_makes_that_row_nan_as_in_eager(tmp_path, is_causal):
    """A row whose scores are all NaN is NaN (forward and gradients), as eager's is: not taken
    for a row with every key masked, which is zero. Causal, eager's key and value gradients are
    NaN for every key of the head, the kernel's for the keys that row attends to."""
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16)
    q[0, 1, 5, 3] = float("nan")

    def attention(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)

    got, want = _compiled_step(attention, (q, k, v), tmp_path), _compiled_step(attention, (q, k, v))
    assert got[0][0, 1, 5].isnan().all() and not got[0][0, 0].isnan().any()
    assert torch.equal(got[0].isnan(), want[0].isnan())
    for a, b in zip(got[1], want[1]):
        assert a.isnan().any() and (b.isnan() | ~a.isnan()).all()  # NaN where eager's is
        if not is_causal:
            assert torch.equal(a.isnan(), b.isnan())
        both = ~(a.isnan() | b.isnan())
        torch.testing.assert_close(a[both], b[both], rtol=1e-4, atol=2e-5)
    assert any(op.startswith("TorchAttention_") for op in _ops_run(tmp_path, "backward"))


class SelfAttention(torch.nn.Module):
    """A transformer's attention block as HF models write it: heads out of each projection's
    rows by a view and a transpose, and back."""

    def __init__(self, hidden=64, heads=4):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (torch.nn.Linear(hidden, hidden) for _ in range(4))

    def forward(self, x):
        b, s, hidden = x.shape

        def split(t):
            return t.view(b, s, self.heads, hidden // self.heads).transpose(1, 2)

        y = F.scaled_dot_product_attention(split(self.q(x)), split(self.k(x)), split(self.v(x)))
        return self.o(y.transpose(1, 2).reshape(b, s, hidden))


def test_heads_in_a_projections_rows_are_read_and_written_in_place(tmp_path):
    """The kernels read q, k and v, and backward its incoming gradient, in the projections'
    [batch, length, heads, head size] layout, and write the output and the gradients so: no
    Transpose or MergeHeads around attention, where ORT would copy each of them."""
    torch.manual_seed(0)
    model = SelfAttention()
    x = torch.randn(3, 20, 64)
    got = _compiled_step(model, (x,), tmp_path)
    _assert_like_eager(got, _compiled_step(model, (x,)))
    for kind in ("forward", "backward"):
        ops = _ops_run(tmp_path, kind)
        assert any(op.startswith("TorchAttention_") for op in ops), ops
        assert "MergeHeads" not in ops, ops
        perms = [list(a.ints) for path in glob.glob(f"{tmp_path}/*{kind}*.onnx")
                 for node in onnx.load(path).graph.node if node.op_type == "Transpose" for a in node.attribute]
        assert [0, 2, 1, 3] not in perms, perms


@pytest.mark.parametrize("options, head", [({}, 24), ({"cpu_attention_kernel": False}, 32)])
def test_attention_the_kernel_does_not_take_is_written_out(tmp_path, options, head):
    """A head size that is not a multiple of 16, or the option off: products and a softmax on
    ORT, eager's values."""
    q, k, v = (torch.randn(2, 2, 10, head) for _ in range(3))

    def attention(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    got = _compiled_step(attention, (q, k, v), tmp_path, options)
    _assert_like_eager(got, _compiled_step(attention, (q, k, v)))
    ops = _ops_run(tmp_path)
    assert not any(op.startswith(("TorchAttention_", "FlashAttention")) for op in ops), ops


def _flash_op_as_kernel(dims, mask_type=None):
    """(model, session) of one FlashAttentionCpu node over inputs of ``dims`` (name: shape; a
    "mask" of ``mask_type``), after the pointwise stage made it ort_dynamo's attention kernel."""
    inputs = [ir.Value(name=name, shape=ir.Shape(shape),
                       type=ir.TensorType(mask_type if name == "mask" else ir.DataType.FLOAT))
              for name, shape in dims.items()]
    node = ir.node("FlashAttentionCpu", inputs, attributes={"is_causal": 0, "has_scale": 0},
                   domain=_torch_attention.DOMAIN, num_outputs=2)
    for value, name in zip(node.outputs, ("out", "logsumexp")):
        value.name, value.dtype = name, ir.DataType.FLOAT
    graph = ir.Graph(inputs, node.outputs, nodes=[node], opset_imports={"": 18, _torch_attention.DOMAIN: 1})
    model = ir.Model(graph, ir_version=10)
    kernels = _pointwise.fuse_pointwise(model)
    assert [n.op_type.startswith("TorchAttention_") for n in model.graph] == [True]
    so = ort.SessionOptions()
    so.register_custom_ops_library(_kernels.library(kernels))
    session = ort.InferenceSession(ir.serde.serialize_model(model).SerializeToString(), so,
                                   providers=["CPUExecutionProvider"])
    return model, session


def test_the_kernel_names_operands_of_the_wrong_shape():
    """The kernel checks at run time what the graph promised: the head size it was built for,
    one batch and head count, key and value of one length."""
    model, session = _flash_op_as_kernel({"q": [2, 3, "m", 16], "k": [2, 3, "n", 16], "v": [2, 3, "n", 16]})
    assert _torch_attention.DOMAIN not in model.opset_imports  # torch's library is not needed
    q, k, v = (np.random.randn(2, 3, 5, 16).astype(np.float32) for _ in range(3))
    out, lse = session.run(None, {"q": q, "k": k, "v": v})
    want = F.scaled_dot_product_attention(*(torch.from_numpy(t) for t in (q, k, v)))
    np.testing.assert_allclose(out, want.numpy(), rtol=1e-5, atol=1e-6)
    with pytest.raises(Exception, match="query, key and value must be"):
        session.run(None, {"q": q, "k": k, "v": v[:, :, :4]})


def test_a_new_length_under_dynamic_shapes_reuses_the_kernels(tmp_path):
    """dynamic=True: the kernels read the lengths at run time, so a new sequence length (and a
    mask of its shape) needs no new export, and the values stay eager's."""
    torch.manual_seed(0)
    model = SelfAttention()
    ort_dynamo.reset()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="ort", dynamic=True,
                             options={"fallback_policy": "DISABLE", "save_onnx": True, "save_path": str(tmp_path)})
    for length in (16, 16, 23, 40):
        x = torch.randn(2, length, 64)
        got = [t.clone().requires_grad_() for t in (x,)]
        out = compiled(*got)
        out.square().sum().backward()
        ort_dynamo.wait_for_kernels()
        want = [x.clone().requires_grad_()]
        model.zero_grad()
        expected = model(*want)
        expected.square().sum().backward()
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[0].grad, want[0].grad, rtol=1e-4, atol=1e-5)
    graphs = ort_dynamo.report().graphs
    assert [g.kind for g in graphs] == ["forward", "backward"], graphs
    assert all(g.exports == g.partitions for g in graphs), graphs  # each partition exported once
    assert any(op.startswith("TorchAttention_") for op in _ops_run(tmp_path, "backward"))


def test_the_saved_output_and_its_heads_merged_into_rows_are_one_memory_as_in_eager():
    """Backward reads attention's output, and the projection after it reads the same values
    with the heads merged into rows: eager saves two views of one tensor. ORT hands back one
    buffer and PyTorch views it twice, instead of an ORT copy per view."""
    torch.manual_seed(0)
    model = SelfAttention()
    ort_dynamo.reset()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="ort")
    x = torch.randn(3, 20, 64)
    compiled(x).sum().backward()
    ort_dynamo.wait_for_kernels()
    saved = []
    parameters = {p.data_ptr() for p in model.parameters()}
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss = compiled(x).sum()
    activations = [t for t in saved if t.data_ptr() not in parameters and t.numel() == 3 * 20 * 64]
    storages = {t.untyped_storage().data_ptr() for t in activations}
    assert len(storages) < len(activations), [(tuple(t.shape), t.stride()) for t in activations]
    loss.backward()


@pytest.mark.parametrize("is_causal, mask_kind", [(True, None), (False, "padding")])
def test_grouped_query_attention_reads_each_key_head_for_its_group(tmp_path, is_causal, mask_kind):
    """enable_gqa (Llama-3's, Mistral's, Qwen2's): 6 query heads over 2 key and value heads.
    The kernels read each key head for its group of 3 query heads, with no copies of k and v
    per query head, and backward sums the group's gradients into it, as eager does."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 6, 40, 32), torch.randn(2, 2, 40, 32), torch.randn(2, 2, 40, 32)
    mask = _mask(mask_kind, 2, 6, 40, 40)

    def attention(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=True)

    got = _compiled_step(attention, (q, k, v), tmp_path)
    _assert_like_eager(got, _compiled_step(attention, (q, k, v)))
    assert [g.shape for g in got[1]] == [q.shape, k.shape, v.shape]
    for kind in ("forward", "backward"):
        ops = _ops_run(tmp_path, kind)
        assert any(op.startswith("TorchAttention_") for op in ops), ops
        assert not {"Expand", "MatMul", "Softmax"} & set(ops), ops


def test_the_kernel_reads_a_bool_mask_where_the_op_is_given_one():
    """The flash op may carry a bool mask (True: attend), which SDPA itself turns additive before
    it: the kernel's bool path against eager, a row with no key to attend to included."""
    _, session = _flash_op_as_kernel({"q": [2, 3, 5, 16], "k": [2, 3, 7, 16], "v": [2, 3, 7, 16], "mask": [5, 7]},
                                     mask_type=ir.DataType.BOOL)
    q, k, v = (np.random.randn(*shape).astype(np.float32) for shape in ((2, 3, 5, 16), (2, 3, 7, 16), (2, 3, 7, 16)))
    mask = np.random.rand(5, 7) > 0.4
    mask[2] = False
    out, _ = session.run(None, {"q": q, "k": k, "v": v, "mask": mask})
    want = F.scaled_dot_product_attention(*(torch.from_numpy(t) for t in (q, k, v)), attn_mask=torch.from_numpy(mask))
    np.testing.assert_allclose(out, want.numpy(), rtol=1e-5, atol=1e-6)
    assert np.all(out[:, :, 2] == 0)
