"""Rewrites: ORT's fused kernels appear in the optimized graphs, and results do not change."""

import collections
import copy
import math
import glob
import os

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
import torch.nn as nn

import ort_dynamo
from ort_dynamo import _op_kernels
from ort_dynamo.options import OrtOptions
from ort_dynamo.run import session_options
from parity import partition_runner


def _optimized_op_types(path):
    kernels = path.replace(".onnx", ".pointwise.so")  # saved beside a model that uses them
    so = session_options(OrtOptions(), kernel_library=kernels if os.path.exists(kernels) else "")
    so.optimized_model_filepath = path + ".optimized"
    ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    return collections.Counter(n.op_type for n in onnx.load(path + ".optimized").graph.node)


def test_backward_matmuls_fuse_into_fused_matmul_with_same_gradients(tmp_path):
    """ORT's own products (``cpu_matmul="ort"``; torch's BLAS folds the transposes itself)."""
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    x = torch.randn(8, 16)
    grads = {}
    for level in ("all", "disable"):
        ort_dynamo.reset()
        clone = nn.Sequential(*[m for m in model])  # same parameters
        clone.zero_grad()
        opts = {"graph_optimization_level": level, "save_onnx": True, "save_path": str(tmp_path / level),
                "cpu_matmul": "ort"}
        torch.compile(clone, backend="ort", options=opts)(x).square().sum().backward()
        grads[level] = [p.grad.clone() for p in clone.parameters()]
    backward = glob.glob(os.path.join(tmp_path, "all", "*backward*.onnx"))[0]
    assert _optimized_op_types(backward)["FusedMatMul"] >= 1
    for fused, plain in zip(grads["all"], grads["disable"]):
        torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-6)


def test_bfloat16_ops_run_on_cpu_in_float32_with_bf16_rounding(tmp_path):
    """ORT's CPU EP lacks bf16 kernels: the rewrite computes in fp32 and rounds each result,
    which is also what eager does on CPU, so results match eager bit for bit here."""
    a = torch.randn(64, dtype=torch.bfloat16)
    b = torch.randn(64, dtype=torch.bfloat16)

    def fn(a, b):
        return (a * b + a).tanh()

    got = torch.compile(fn, backend="ort", options={"save_onnx": True, "save_path": str(tmp_path)})(a, b)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, fn(a, b), rtol=0, atol=0)
    assert ort_dynamo.report().fallback_nodes == 0
    model = onnx.load(glob.glob(str(tmp_path / "*.onnx"))[0])
    casts = [n for n in model.graph.node if n.op_type == "Cast"]
    assert len(casts) >= 4  # up-casts of a and b, down-casts of each op's result


# -- fusions into ORT's fused CPU kernels (ort_dynamo/_fusions.py) ---------------------------------

def _train_fused_and_plain(model, x, tmp_path, fused_options=None):
    """One training step with the rewrites on and off (``enable_compute_optimizer=False``);
    returns {"fused"|"plain": [output, *grads]} and the op counts of each saved fused graph.
    ``fused_options`` default to the ORT-kernel fusions alone (no pointwise kernels)."""
    results, ops = {}, {}
    fused_options = {"pointwise_kernels": False} if fused_options is None else fused_options
    for name, options in (("fused", fused_options), ("plain", {"enable_compute_optimizer": False})):
        ort_dynamo.reset()
        model.zero_grad()
        out = torch.compile(model, backend="ort",
                            options={**options, "save_onnx": True, "save_path": str(tmp_path / name)})(x)
        out.square().sum().backward()
        results[name] = [out.detach()] + [p.grad.clone() for p in model.parameters() if p.requires_grad]
        assert ort_dynamo.report().fallback_nodes == 0
    for kind in ("forward", "backward"):
        path = glob.glob(str(tmp_path / "fused" / f"*{kind}*.onnx"))[0]
        ops[kind] = collections.Counter(n.op_type for n in onnx.load(path).graph.node)
    for fused, plain in zip(results["fused"], results["plain"]):
        # Fused kernels round differently: allow 1e-5 of each tensor's scale (sums of
        # gradients cancel, so an elementwise relative bound would measure the cancellation).
        torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5 * plain.abs().max().item())
    return results, ops


class _GeluMlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x):
        return nn.functional.gelu(self.down(nn.functional.gelu(self.up(x))), approximate="tanh")


def test_gelu_chains_fuse_into_gelu_and_fast_gelu_with_same_gradients(tmp_path):
    torch.manual_seed(0)
    _, ops = _train_fused_and_plain(_GeluMlp(), torch.randn(4, 8, 16), tmp_path)
    assert ops["forward"]["Gelu"] == 1 and ops["forward"]["Erf"] == 0
    assert ops["forward"]["FastGelu"] == 1 and ops["forward"]["Tanh"] == 0


class _ResidualMlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x):
        return x + self.down(nn.functional.gelu(self.up(x)))


@pytest.mark.parametrize("kernels", [False, True])
def test_linear_biases_are_added_after_the_reshape_not_by_gemm(tmp_path, kernels):
    """A 3-D Linear is addmm then a view; ORT's Gemm broadcasts the bias over its output first.
    The bias moves after the view, as an Add beside the GELU and into the residual add."""
    torch.manual_seed(0)
    _, ops = _train_fused_and_plain(_ResidualMlp(), torch.randn(4, 8, 16), tmp_path,
                                    fused_options={"pointwise_kernels": kernels})
    assert ops["forward"]["Gemm"] == 0 and ops["forward"]["MatMul"] == 2 and ops["forward"]["Gelu"] == 1


class _BiasedAttention(nn.Module):
    """BERT's self-attention (biased q, k and v projections split into heads) or, ``fused``,
    GPT-2's (one projection to q, k and v, split on its last axis)."""

    def __init__(self, hidden=64, heads=4, fused=False):
        super().__init__()
        self.heads, self.fused = heads, fused
        if fused:
            self.qkv = nn.Linear(hidden, 3 * hidden)
        else:
            self.q, self.k, self.v = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)
            # Softmax ignores a shift per row, so k's bias has a true gradient of 0: only rounding
            # noise, which no relative tolerance compares. Frozen, it still goes through the rewrite.
            self.k.bias.requires_grad_(False)

    def forward(self, x):
        b, s, h = x.shape

        def split(t):
            return t.view(b, s, self.heads, h // self.heads).transpose(1, 2)

        q, k, v = self.qkv(x).split(h, dim=2) if self.fused else (self.q(x), self.k(x), self.v(x))
        q, k, v = split(q), split(k), split(v)
        probs = (q @ k.transpose(-1, -2) / math.sqrt(h // self.heads)).softmax(-1)
        return (probs @ v).transpose(1, 2).reshape(b, s, h)


def _head_split_transposes(path):
    return sum(1 for n in onnx.load(path).graph.node if n.op_type == "Transpose"
               and [a.ints for a in n.attribute if a.name == "perm"] == [[0, 2, 1, 3]])


@pytest.mark.parametrize("fused_qkv", [False, True])
@pytest.mark.parametrize("kernels", [False, True])
def test_attention_biases_are_added_in_the_heads_layout_not_by_gemm(tmp_path, kernels, fused_qkv):
    """q, k and v are addmm, two views and a Transpose into heads (GPT-2: one addmm split
    in three first). The bias moves past the views (as [heads, d]; split in three with the
    product); with pointwise kernels the Add is a kernel that writes the heads' layout itself,
    so the Transpose's pass goes too; the context's move back into rows is ``MergeHeads``.
    Same outputs and gradients."""
    torch.manual_seed(0)
    model = _BiasedAttention(fused=fused_qkv)
    _, ops = _train_fused_and_plain(model, torch.randn(4, 64, 64), tmp_path,
                                    fused_options={"pointwise_kernels": kernels})
    assert ops["forward"]["Gemm"] == 0 and ops["forward"]["MatMul"] >= 3, ops["forward"]
    forward = glob.glob(str(tmp_path / "fused" / "*forward*.onnx"))[0]
    plain = glob.glob(str(tmp_path / "plain" / "*forward*.onnx"))[0]
    # Plain: q, k and v each split into heads by a Transpose (the context's is [0, 2, 1, 3] too).
    assert _head_split_transposes(plain) == 4
    assert _head_split_transposes(forward) == (0 if kernels else 4)
    assert [n.op_type for n in onnx.load(forward).graph.node].count("MergeHeads") == (1 if kernels else 0)


class _NewGelu(nn.Module):
    """GPT-2's GELU written out (``gelu_new``), in two spellings, and a look-alike that is not
    GELU (another constant)."""

    def __init__(self, spelling="gpt2"):
        super().__init__()
        self.up, self.spelling = nn.Linear(16, 32), spelling

    def forward(self, x):
        h = self.up(x)
        if self.spelling == "gpt2":
            return 0.5 * h * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * torch.pow(h, 3.0))))
        if self.spelling == "methods":
            return h.mul(0.5).mul((h + h * h * h * 0.044715).mul(0.7978845608).tanh() + 1)
        return 0.5 * h * (1.0 + torch.tanh(0.8 * (h + 0.044715 * torch.pow(h, 3.0))))


@pytest.mark.parametrize("spelling", ["gpt2", "methods"])
def test_written_out_tanh_gelu_trains_as_one_fast_gelu(tmp_path, spelling):
    """As one ``F.gelu(approximate="tanh")`` autograd saves only its input, and the forward is
    ORT's FastGelu; with the rewrites off the chain stays as written. Same results."""
    torch.manual_seed(0)
    model, x = _NewGelu(spelling), torch.randn(4, 8, 16)
    _, ops = _train_fused_and_plain(model, x, tmp_path)
    assert ops["forward"]["FastGelu"] == 1 and ops["forward"]["Tanh"] == 0, ops["forward"]
    # The chain the GELU replaced is not mistaken for other readers of the Linear's output:
    # its bias still moves out of the Gemm.
    assert ops["forward"]["Gemm"] == 0 and ops["forward"]["MatMul"] == 1, ops["forward"]
    plain = onnx.load(glob.glob(str(tmp_path / "plain" / "*forward*.onnx"))[0])
    assert [n.op_type for n in plain.graph.node].count("Tanh") == 1
    torch.testing.assert_close(torch.compile(model, backend="ort")(x), model(x), rtol=1e-5, atol=1e-6)


def test_a_tanh_expression_that_is_not_gelu_is_left_as_written(tmp_path):
    torch.manual_seed(0)
    _, ops = _train_fused_and_plain(_NewGelu("not gelu"), torch.randn(4, 8, 16), tmp_path)
    assert ops["forward"]["FastGelu"] == 0 and ops["forward"]["Tanh"] == 1


class _RmsNorm(nn.Module):
    """Llama's RMSNorm between two projections."""

    def __init__(self):
        super().__init__()
        self.up, self.weight = nn.Linear(16, 32), nn.Parameter(torch.rand(32) + 0.5)

    def forward(self, x):
        h = self.up(x)
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6))


def _pow_exponents(path):
    model = onnx.load(path)
    constants = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Constant":
            value = onnx.helper.get_attribute_value(node.attribute[0])
            constants[node.output[0]] = onnx.numpy_helper.to_array(value) \
                if isinstance(value, onnx.TensorProto) else value
    # (a one-element exponent of any rank: over a last axis of 1 it has the base's rank)
    return [float(np.asarray(constants[n.input[1]]).reshape(-1)[0]) for n in model.graph.node if n.op_type == "Pow"]


def test_rms_norm_fuses_into_simplified_layer_norm_and_pow_one_is_dropped(tmp_path):
    torch.manual_seed(0)
    _, ops = _train_fused_and_plain(_RmsNorm(), torch.randn(4, 8, 16), tmp_path)
    assert ops["forward"]["SimplifiedLayerNormalization"] == 1 and ops["forward"]["ReduceMean"] == 0
    # d(h**2)/dh = 2 * h**1: the Pow(h, 1) of the plain backward is gone.
    assert 1.0 in _pow_exponents(glob.glob(str(tmp_path / "plain" / "*backward*.onnx"))[0])
    assert 1.0 not in _pow_exponents(glob.glob(str(tmp_path / "fused" / "*backward*.onnx"))[0])


class _StridedPixels(nn.Module):
    """Every other pixel of every third row of the first image, four slices in torch (one per
    axis), then a 1x1 convolution: ResNet's stride-2 shortcut reads its input so."""

    def __init__(self):
        super().__init__()
        self.mix = nn.Conv2d(4, 6, 1)

    def forward(self, x):
        return self.mix(x[:, 1:, ::3, 1::2][:1] * 2)


def test_slices_of_slices_along_other_axes_are_one_slice(tmp_path):
    torch.manual_seed(0)
    x = torch.randn(2, 5, 9, 10, requires_grad=True)
    _, ops = _train_fused_and_plain(_StridedPixels(), x, tmp_path)
    assert ops["forward"]["Slice"] == 1, ops["forward"]
    plain = glob.glob(str(tmp_path / "plain" / "*forward*.onnx"))[0]
    assert collections.Counter(n.op_type for n in onnx.load(plain).graph.node)["Slice"] > 1


class _IndexSelect(nn.Module):
    """``index_select`` along the last axis by ``torch.arange(*run)`` (XLNet's relative shift keeps
    ``arange(klen)`` of a longer axis), after a product so there is something to train."""

    def __init__(self, run):
        super().__init__()
        self.run = run
        self.proj = nn.Linear(10, 10)

    def forward(self, x):
        return torch.index_select(self.proj(x), -1, torch.arange(*self.run)).exp()


@pytest.mark.parametrize("run, gathers", [
    ((2, 8), 0),  # a run inside the axis: a Slice
    ((0, 10), 0),  # the whole axis
    ((0, 6, 2), 1),  # every other index: not a run
    ((3, 0, -1), 1),  # a run backwards
])
def test_an_index_select_of_a_run_of_indices_is_a_slice(tmp_path, run, gathers):
    torch.manual_seed(0)
    x = torch.randn(3, 4, 10, requires_grad=True)
    _, ops = _train_fused_and_plain(_IndexSelect(run), x, tmp_path)
    assert ops["forward"]["Gather"] == gathers, ops["forward"]


def test_reshaped_outputs_come_back_as_views_not_copies():
    """ORT copies a Reshape that is a graph output (inside a partition: e.g. a value handed from
    one backward segment to the next); the rewrite outputs its input and PyTorch takes a
    .view(shape) instead. Views that are outputs of the whole graph are PyTorch views before
    export already (tests/test_backward_memory.py)."""
    def partition(x):
        y = x.tanh() * 2
        return y.view(-1), y.view(20, 1).sin()

    exported, runner = partition_runner(partition, torch.randn(4, 5))
    assert [slot.kind for slot in exported.slots] == ["view", "ort"], exported.slots
    x = torch.randn(4, 5)
    flat, sines = runner(x)
    torch.testing.assert_close(flat, partition(x)[0])
    torch.testing.assert_close(sines, partition(x)[1])
    assert flat.shape == (20,) and flat._base is not None  # a view of the buffer ORT returned


def _qkv_projection_split_by(sizes_from: str) -> onnx.ModelProto:
    """GPT-2's fused q/k/v projection as ONNX: Gemm -> Reshape -> Split of the last axis into
    three (sizes from an initializer or a ``Constant`` node) -> per piece a Reshape into
    [B, S, heads, d] and a Transpose into heads."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((16, 48)).astype(np.float32), "w"),
             numpy_helper.from_array(rng.standard_normal(48).astype(np.float32), "bias"),
             numpy_helper.from_array(np.array([2, 4, 48], np.int64), "tokens_shape"),
             numpy_helper.from_array(np.array([2, 4, 2, 8], np.int64), "heads_shape")]
    nodes = [helper.make_node("Gemm", ["x", "w", "bias"], ["qkv"]),
             helper.make_node("Reshape", ["qkv", "tokens_shape"], ["qkv_3d"])]
    if sizes_from == "initializer":
        inits.append(numpy_helper.from_array(np.array([16, 16, 16], np.int64), "sizes"))
    else:
        nodes.append(helper.make_node("Constant", [], ["sizes"], value_ints=[16, 16, 16]))
    nodes.append(helper.make_node("Split", ["qkv_3d", "sizes"], ["q", "k", "v"], axis=-1))
    for name in "qkv":
        nodes += [helper.make_node("Reshape", [name, "heads_shape"], [f"{name}_4d"]),
                  helper.make_node("Transpose", [f"{name}_4d"], [f"{name}_heads"], perm=[0, 2, 1, 3])]
    graph = helper.make_graph(nodes, "qkv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 16])],
                              [helper.make_tensor_value_info(f"{n}_heads", TensorProto.FLOAT, [2, 2, 4, 8])
                               for n in "qkv"], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    return onnx.shape_inference.infer_shapes(model)


@pytest.mark.parametrize("sizes_from", ["initializer", "constant_node"])
def test_split_qkv_bias_leaves_the_gemm_whatever_holds_the_split_sizes(sizes_from):
    """The split sizes may come from an initializer or a ``Constant`` node (what the exporter
    left unfolded); either way each piece gets its slice of the bias, and the outputs agree."""
    import onnx_ir as ir

    from ort_dynamo import _fusions

    proto = _qkv_projection_split_by(sizes_from)
    model = ir.serde.deserialize_model(proto)
    assert _fusions.bias_after_reshape(model.graph) == 1
    ops = collections.Counter(node.op_type for node in model.graph)
    assert ops["Gemm"] == 0 and ops["MatMul"] == 1 and ops["Add"] == 3, ops

    x = np.random.default_rng(1).standard_normal((8, 16)).astype(np.float32)

    def run(m):
        return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})

    for got, want in zip(run(ir.serde.serialize_model(model)), run(proto)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype, fill", [(torch.int64, -100), (torch.int32, 7), (torch.bool, True)])
def test_an_integer_pad_is_a_concat_on_cuda_with_the_same_values(dtype, fill):
    """ORT's CUDA provider pads float types only: an int64 Pad (GPT-2's loss pads its labels)
    ran on the CPU, with copies and a host wait for the GPU. On CUDA it becomes a Concat of
    constant blocks: run here on the CPU provider, both give torch's values."""
    import onnx_ir as ir

    from ort_dynamo.export import export_graph
    from ort_dynamo.rewrite import _integer_pads_as_concat

    x = torch.randint(0, 2, (3, 5)).to(dtype)
    gm = torch.fx.symbolic_trace(lambda t: torch.nn.functional.pad(t, (0, 1, 2, 0), value=fill))
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    gm = torch.fx.experimental.proxy_tensor.make_fx(gm)(x)
    FakeTensorProp(gm, FakeTensorMode()).propagate(x)
    exported = export_graph(gm, 18)
    model = exported.model
    ir.passes.common.InlinePass()(model)
    import onnxscript.optimizer

    onnxscript.optimizer.fold_constants(model, onnx_shape_inference=False)
    before = ir.serde.serialize_model(model).SerializeToString()
    assert [n.op_type for n in model.graph].count("Pad") == 1
    assert _integer_pads_as_concat(model.graph) == 1
    assert "Pad" not in [n.op_type for n in model.graph] and "Concat" in [n.op_type for n in model.graph]
    after = ir.serde.serialize_model(model).SerializeToString()
    want = torch.nn.functional.pad(x, (0, 1, 2, 0), value=fill).numpy()
    feed = {exported.input_names[0]: x.numpy()}
    for blob in (before, after):
        got = ort.InferenceSession(blob, providers=["CPUExecutionProvider"]).run(None, feed)[0]
        np.testing.assert_array_equal(got, want)


def test_a_float_pad_stays_a_pad_on_cuda():
    import onnx_ir as ir

    from ort_dynamo.rewrite import _integer_pads_as_concat

    x = ir.Value(name="x", shape=ir.Shape([2, 3]), type=ir.TensorType(ir.DataType.FLOAT))
    pads = ir.Value(name="pads", shape=ir.Shape([4]), type=ir.TensorType(ir.DataType.INT64),
                    const_value=ir.tensor(np.array([0, 1, 0, 1], dtype=np.int64)))
    node = ir.node("Pad", [x, pads])
    graph = ir.Graph([x], [node.outputs[0]], nodes=[node], initializers=[pads], opset_imports={"": 18})
    assert _integer_pads_as_concat(graph) == 0 and [n.op_type for n in graph] == ["Pad"]


def _transpose_model(dims, perm, read_by_product=False):
    x = ir.Value(name="x", shape=ir.Shape(list(dims)), type=ir.TensorType(ir.DataType.FLOAT))
    nodes = [ir.node("Transpose", [x], attributes={"perm": list(perm)})]
    if read_by_product:
        w = ir.Value(name="w", shape=ir.Shape([dims[perm[-1]], 3]), type=ir.TensorType(ir.DataType.FLOAT))
        nodes.append(ir.node("MatMul", [nodes[0].outputs[0], w]))
    y = nodes[-1].outputs[0]
    y.name, y.dtype = "y", ir.DataType.FLOAT
    inputs = [x, w] if read_by_product else [x]
    return ir.Model(ir.Graph(inputs, [y], nodes=nodes, opset_imports={"": 18}), ir_version=10)


@pytest.mark.parametrize("dims, perm, add_nodes, ops, inner_perm", [
    # torch's einsum ("ibnd,jbnd->bnij", XLNet): a size-1 axis innermost moves
    ((4, 4, 64, 1, 32), (2, 0, 1, 4, 3), True, ["Squeeze", "Transpose", "Unsqueeze"], [2, 0, 1, 3]),
    ((128, 4, 4, 32, 1), (1, 2, 4, 0, 3), True, ["Squeeze", "Transpose", "Unsqueeze"], [1, 2, 0, 3]),
    (("n", 4, 64, 1, 32), (2, 0, 1, 4, 3), True, ["Squeeze", "Transpose", "Unsqueeze"], [2, 0, 1, 3]),  # dynamic
    ((64, 4, 4, 32, 1), (1, 2, 4, 0, 3), False, ["Transpose"], None),        # CUDA: no nodes added
    ((64, 4, 1, 4, 32), (0, 1, 3, 4, 2), True, ["Reshape"], None),           # only a size-1 axis moves
    ((64, 4, 1, 4, 32), (0, 1, 3, 4, 2), False, ["Reshape"], None),          # one node for one: CUDA too
    (("n", 4, 1, 4, 32), (0, 1, 3, 4, 2), True, ["Squeeze", "Unsqueeze"], None),  # the same, dynamic
    ((2, 2, 8, 1, 8), (2, 0, 1, 4, 3), True, ["Transpose"], None),           # too small to pay two views
    ((8, 128, 4, 64), (0, 2, 1, 3), True, ["Transpose"], None),              # no axis of size 1
])
def test_a_transpose_moves_no_axis_of_size_one(dims, perm, add_nodes, ops, inner_perm):
    """ORT's Transpose goes element by element when its innermost axis moves, even an axis of
    size 1 (238 us against 48 for XLNet's [4, 4, 64, 1, 32]): the rewrite takes such axes out
    around the Transpose, and the values are the same."""
    model = _transpose_model(dims, perm)
    _op_kernels.transposes_without_unit_axes(model.graph, add_nodes=add_nodes)
    assert [n.op_type for n in model.graph] == ops
    if inner_perm is not None:
        assert list(model.graph.node(1).attributes.get_ints("perm")) == inner_perm
    session = ort.InferenceSession(ir.serde.serialize_model(model).SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    data = np.random.randn(*[d if isinstance(d, int) else 3 for d in dims]).astype(np.float32)
    np.testing.assert_array_equal(session.run(["y"], {"x": data})[0], data.transpose(perm))


def test_a_transpose_a_product_reads_stays_for_ort_to_fold():
    model = _transpose_model((4, 4, 64, 1, 32), (2, 0, 1, 4, 3), read_by_product=True)
    assert _op_kernels.transposes_without_unit_axes(model.graph) == 0
    assert [n.op_type for n in model.graph] == ["Transpose", "MatMul"]


@pytest.mark.parametrize("dynamic", [False, True])
def test_einsum_attention_trains_with_transposes_over_no_axis_of_size_one(tmp_path, dynamic):
    """XLNet's relative attention, written with einsum: torch's einsum unsqueezes its operands
    into 5-D views and permutes them; on ORT no Transpose keeps an axis of size 1 (XLNet's
    step 1.12x eager's before, 0.93x after: benchmarks/hf_models.py xlnet)."""
    def attention(q, k, v):
        scores = torch.einsum("ibnd,jbnd->bnij", q, k).softmax(-1)
        return torch.einsum("bnij,jbnd->ibnd", scores, v)

    torch.manual_seed(0)
    q, k, v = (torch.randn(64, 4, 4, 32, requires_grad=True) for _ in range(3))
    compiled = torch.compile(attention, backend="ort", dynamic=dynamic,
                             options={"save_onnx": True, "save_path": str(tmp_path)})
    got = compiled(q, k, v)
    got_grads = torch.autograd.grad(got.square().sum(), (q, k, v))
    want = attention(q, k, v)
    want_grads = torch.autograd.grad(want.square().sum(), (q, k, v))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for g, w in zip(got_grads, want_grads):  # sums in another order: within float32's rounding of the largest
        torch.testing.assert_close(g, w, rtol=1e-5, atol=4e-6 * w.abs().max().item())
    transposes = 0
    for path in glob.glob(str(tmp_path / "*.onnx")):
        model = onnx.shape_inference.infer_shapes(onnx.load(path))
        shapes = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim]
                  for v in [*model.graph.value_info, *model.graph.input]}
        for node in model.graph.node:
            if node.op_type == "Transpose":
                transposes += 1
                assert 1 not in shapes[node.input[0]], (path, node.name, shapes[node.input[0]])
    assert transposes >= 2


def _broadcast_model(op, dims, constant_dims, constant_first=False):
    x = ir.Value(name="x", shape=ir.Shape(list(dims)), type=ir.TensorType(ir.DataType.FLOAT))
    c = ir.Value(name="c", shape=ir.Shape(list(constant_dims)), type=ir.TensorType(ir.DataType.FLOAT),
                 const_value=ir.tensor(np.full(constant_dims, 1.5, dtype=np.float32)))
    node = ir.node(op, [c, x] if constant_first else [x, c])
    node.outputs[0].name, node.outputs[0].dtype = "y", ir.DataType.FLOAT
    graph = ir.Graph([x], node.outputs, nodes=[node], initializers=[c], opset_imports={"": 18})
    return ir.Model(graph, ir_version=10)


@pytest.mark.parametrize("op, dims, constant_dims, changed", [
    ("Mul", (8, 320, 1, 1), (), 1),       # a pooler's [N, C, 1, 1] by a scalar
    ("Pow", (8, 128, 1), (), 1),          # a norm's statistics
    ("Sub", (8, 128, 1), (1,), 1),        # the constant first
    ("Mul", ("n", 128, 1), (), 1),        # dynamic batch: the result's last axis is still 1
    ("Mul", (8, 128, 64), (), 0),         # a longer last axis: a scalar is ORT's fast case
    ("Mul", (8, 128, "m"), (), 0),        # a last axis that may be longer
    ("Mul", (8, 128, 1), (1, 1, 1), 0),   # already of the result's rank
    ("Mul", (8, 1), (2,), 0),             # not one element: left as it is
])
def test_a_one_element_operand_gets_the_results_rank_where_its_last_axis_is_one(op, dims, constant_dims, changed):
    """ORT's CPU broadcasting of a one-element operand of fewer axes over a result whose last
    axis is 1 goes element by element (Mul of [8, 320, 1, 1] by a scalar: 22 us against 4.1 by
    [1, 1, 1, 1], benchmarks/broadcasts.py); the rewrite gives the constant the result's rank, and the
    values are ORT's before (a Pow by 1.5 here; by 2 or 3, the test below)."""
    constant_first = op == "Sub"
    model = _broadcast_model(op, dims, constant_dims, constant_first)
    before = ir.serde.serialize_model(model).SerializeToString()
    assert _op_kernels.one_element_operands_at_full_rank(model.graph) == changed
    operand = model.graph.node(0).inputs[0 if constant_first else 1]
    assert list(operand.shape.dims) == ([1] * len(dims) if changed else list(constant_dims))
    if operand.shape.dims != constant_dims:
        assert np.all(operand.const_value.numpy() == 1.5)
    data = np.random.randn(*[d if isinstance(d, int) else 3 for d in dims]).astype(np.float32) + 2
    want, got = (ort.InferenceSession(m, providers=["CPUExecutionProvider"]).run(["y"], {"x": data})[0]
                 for m in (before, ir.serde.serialize_model(model).SerializeToString()))
    assert got.shape == want.shape
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("exponent", [2.0, 3.0])
def test_a_power_by_two_or_three_at_the_results_rank_is_eagers_product(exponent):
    """Pow by 2 or 3 over a last axis of 1: ORT's element-by-element path (a scalar exponent)
    calls powf, 1 ulp off for some values; with the exponent at the result's rank ORT multiplies,
    as eager's x.pow(2) does, so the rewrite gives eager's values exactly."""
    x = np.abs(np.random.default_rng(0).standard_normal((8, 320, 1, 1))).astype(np.float32) + 0.1
    model = _broadcast_model("Pow", x.shape, ())
    model.graph.initializers["c"].const_value = ir.tensor(np.array(exponent, dtype=np.float32))
    assert _op_kernels.one_element_operands_at_full_rank(model.graph) == 1
    got = ort.InferenceSession(ir.serde.serialize_model(model).SerializeToString(),
                               providers=["CPUExecutionProvider"]).run(["y"], {"x": x})[0]
    np.testing.assert_array_equal(got, torch.from_numpy(x).pow(exponent).numpy())


def test_a_pooled_map_by_scalars_trains_as_eager_with_constants_of_its_rank(tmp_path):
    """EfficientNet's pooler (a window larger than the map) then scalar arithmetic on the
    [N, C, 1, 1] result, trained: the graphs ORT runs hold no one-element constant of fewer
    axes where an op's result ends in an axis of size 1, and the gradients are eager's."""
    def head(x):
        pooled = torch.nn.functional.avg_pool2d(x, 320, ceil_mode=True)
        return (pooled * 1.5).square().sum() + torch.where(pooled > 0, pooled, 0.25).sum()

    torch.manual_seed(0)
    x = torch.randn(8, 320, 4, 4, requires_grad=True)
    compiled = torch.compile(head, backend="ort", options={"save_onnx": True, "save_path": str(tmp_path),
                                                          "pointwise_kernels": False})
    got = compiled(x)
    (got_grad,) = torch.autograd.grad(got, x)
    want = head(x)
    (want_grad,) = torch.autograd.grad(want, x)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_grad, want_grad)
    checked = 0
    for path in glob.glob(str(tmp_path / "*.onnx")):
        model = onnx.shape_inference.infer_shapes(onnx.load(path))
        shapes = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim]
                  for v in [*model.graph.value_info, *model.graph.input, *model.graph.output]}
        shapes.update({t.name: list(t.dims) for t in model.graph.initializer})
        shapes.update({n.output[0]: list(n.attribute[0].t.dims) for n in model.graph.node if n.op_type == "Constant"})
        for node in model.graph.node:
            result = shapes.get(node.output[0])
            if node.op_type in ("Mul", "Pow", "Where", "Greater") and result and result[-1] == 1:
                checked += 1
                assert all(len(shapes[i]) == len(result) for i in node.input), \
                    (path, node.op_type, [shapes[i] for i in node.input])
    assert checked >= 3


def test_a_view_of_a_view_between_products_is_no_reshape_at_all():
    """AOTAutograd views a product's result as [B, S, N] and back to [B*S, N] for the next
    product: a Reshape of a Reshape to the shape it started from. Each Reshape is a node ORT
    dispatches (host time on CUDA), so the rewrite collapses such chains and drops a Reshape to
    its input's own shape; the values stay eager's."""
    def partition(x, w1, w2):
        h = (x.view(8, 16) @ w1).view(2, 4, 32)
        h = h.view(8, 32) @ w2
        return (h.view(2, 4, 8) + 1).tanh(), h.view(2, 4, 8).view(-1, 2)

    x, w1, w2 = torch.randn(2, 4, 16), torch.randn(16, 32), torch.randn(32, 8)
    exported, runner = partition_runner(partition, x, w1, w2)
    graph = exported.model.graph
    for node in graph:
        if node.op_type == "Reshape":
            source = node.inputs[0]
            assert source.producer() is None or source.producer().op_type != "Reshape", node
            assert list(source.shape.dims) != list(node.outputs[0].shape.dims), node
    got, flat = runner(x, w1, w2)
    want = partition(x, w1, w2)
    torch.testing.assert_close(got, want[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(flat, want[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dynamic", [False, True])
def test_batch_norm_broadcasts_each_channel_vector_with_one_unsqueeze(tmp_path, dynamic):
    """Batch norm's decompositions unsqueeze each per-channel vector one axis at a time, and its
    backward squeezes a [1, C, 1, 1] statistic to [C] only to unsqueeze it back. The rewrite
    composes the chains (rank arithmetic, so symbolic shapes too) and drops the round trips;
    training stays eager's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 3), nn.BatchNorm2d(4))
    twin = copy.deepcopy(model)
    x = torch.randn(4, 3, 10, 10)
    compiled = torch.compile(model, backend="ort", dynamic=dynamic,
                             options={"save_onnx": True, "save_path": str(tmp_path)})
    got = compiled(x)
    got.square().mean().backward()
    want = twin(x)
    want.square().mean().backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for mine, eager in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(mine.grad, eager.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(model[1].running_var, twin[1].running_var)
    unsqueezes = 0
    for path in glob.glob(str(tmp_path / "*.onnx")):
        graph = onnx.load(path).graph
        producer = {out: node for node in graph.node for out in node.output}
        for node in graph.node:
            if node.op_type != "Unsqueeze":
                continue
            unsqueezes += 1
            inner = producer.get(node.input[0])
            assert inner is None or inner.op_type not in ("Unsqueeze", "Squeeze"), (path, node.name, inner.op_type)
    assert unsqueezes >= 4  # the per-channel broadcasts themselves stay
