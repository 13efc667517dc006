"""Pointwise kernels: elementwise chains run as one generated C kernel each, with the results
of ORT's separate kernels (ort_dynamo/_pointwise.py, _kernels.py, csrc/pointwise.h)."""

import ctypes
import functools
import gc
import glob
import json
import math
import os
import shutil
import subprocess

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ort_dynamo
from ort_dynamo import _kernels, _pointwise
from ort_dynamo.run import OrtRunner

pytestmark = pytest.mark.skipif(not _kernels.available(), reason="no C compiler to build kernels with")


class _SwiGluAttention(nn.Module):
    """Llama's elementwise chains: SiLU-gated MLP, masked softmax, a residual add."""

    def __init__(self):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(64, 96), nn.Linear(64, 96), nn.Linear(96, 64)

    def forward(self, x):
        scores = x @ x.transpose(-1, -2) / 8.0
        mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()
        attention = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ x
        return x + self.down(nn.functional.silu(self.gate(attention)) * self.up(attention))


def _step(model, x, options, tmp_path=None):
    """A training step on ORT once the kernels are built (the steps before run without them)."""
    ort_dynamo.reset()
    if tmp_path is not None:
        options = {**options, "save_onnx": True, "save_path": str(tmp_path)}
    compiled = torch.compile(model, backend="ort", options=options)
    compiled(x).square().sum().backward()
    ort_dynamo.wait_for_kernels()
    model.zero_grad()
    out = compiled(x)
    out.square().sum().backward()
    assert ort_dynamo.report().fallback_nodes == 0
    return [out.detach()] + [p.grad.clone() for p in model.parameters()]


def _pointwise_nodes(path):
    return [n for n in onnx.load(path).graph.node if n.domain == _pointwise.DOMAIN]


def test_elementwise_chains_train_as_generated_kernels_with_the_same_results(tmp_path):
    torch.manual_seed(0)
    model, x = _SwiGluAttention(), torch.randn(4, 64, 64)
    fused = _step(model, x, {}, tmp_path)
    kernels = ort_dynamo.report().kernels
    plain = _step(model, x, {"pointwise_kernels": False})
    eager = [model(x).detach()]
    model.zero_grad()
    model(x).square().sum().backward()
    eager += [p.grad.clone() for p in model.parameters()]
    assert kernels >= 2
    backward = glob.glob(str(tmp_path / "*backward*.onnx"))
    assert any(len(n.doc_string.split("|")) >= 3 for path in backward for n in _pointwise_nodes(path))
    for got, unfused, want in zip(fused, plain, eager):
        torch.testing.assert_close(got, unfused, rtol=1e-5, atol=1e-5 * unfused.abs().max().item())
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_without_kernels_the_chains_stay_ort_ops(tmp_path):
    torch.manual_seed(0)
    _step(_SwiGluAttention(), torch.randn(4, 64, 64), {"pointwise_kernels": False}, tmp_path)
    assert ort_dynamo.report().kernels == 0
    assert not any(_pointwise_nodes(p) for p in glob.glob(str(tmp_path / "*.onnx")))


# Kernels are made for groups of at least _pointwise.MIN_ELEMENTS (16384) elements.
@pytest.mark.parametrize("shapes", [
    [(16, 32, 48), (16, 32, 48)],                # full
    [(16, 32, 48), ()],                          # scalar tensor
    [(16, 32, 48), (32, 48)],                    # suffix (a bias, RoPE's tables)
    [(16, 32, 48), (16, 32, 1)],                 # col (a reduction's result)
    [(16, 32, 48), (16, 1, 48), (1, 32, 1)],     # general: strided reads
])
def test_broadcast_read_patterns_match_eager(shapes):
    def fn(*xs):
        y = xs[0]
        for other in xs[1:]:
            y = torch.sigmoid(y * other) - other / 3.0
        return y.exp().tanh() + y

    xs = [torch.randn(s) for s in shapes]
    ort_dynamo.reset()
    compiled = torch.compile(fn, backend="ort")
    compiled(*xs)
    ort_dynamo.wait_for_kernels()
    got = compiled(*xs)
    assert ort_dynamo.report().kernels == 1
    torch.testing.assert_close(got, fn(*xs), rtol=1e-5, atol=1e-6)


def test_where_keeps_eager_semantics_for_masks_and_infinities():
    def fn(scores, mask, x):
        filled = scores.masked_fill(mask, float("-inf"))
        return torch.where(filled > 0, x, filled * 2), filled.exp()

    scores, mask, x = torch.randn(4, 64, 128), torch.rand(4, 1, 128) > 0.5, torch.randn(128)
    compiled = torch.compile(fn, backend="ort")
    compiled(scores, mask, x)
    ort_dynamo.wait_for_kernels()
    got = compiled(scores, mask, x)
    for g, want in zip(got, fn(scores, mask, x)):
        torch.testing.assert_close(g, want, rtol=1e-6, atol=0)


def _kernel_model(x_shape, y_shape, build=None):
    """An ONNX model with one pointwise kernel (default: x * y + x) generated for these shapes,
    then stripped of its input shapes so that ORT feeds whatever shapes it is given."""
    x = ir.Value(name="x", shape=ir.Shape(x_shape), type=ir.TensorType(ir.DataType.FLOAT))
    y = ir.Value(name="y", shape=ir.Shape(y_shape), type=ir.TensorType(ir.DataType.FLOAT))
    nodes = (build or (lambda x, y: [ir.node("Mul", [x, y]), None]))(x, y)
    if nodes[-1] is None:
        nodes[-1] = ir.node("Add", [nodes[0].outputs[0], x])
    outputs = [n.outputs[0] for n in nodes[-1:]]
    outputs[0].name = "out"
    graph = ir.Graph([x, y], outputs, nodes=nodes, opset_imports={"": 18})
    model = ir.Model(graph, ir_version=10)
    kernels = _pointwise.fuse_pointwise(model)
    assert len(kernels) == 1 and len([n for n in model.graph if n.op_type != "Constant"]) == 1
    for value in (x, y):
        value.shape = None
    library = _kernels.library(kernels)
    so = ort.SessionOptions()
    so.register_custom_ops_library(library)
    return ort.InferenceSession(ir.serde.serialize_model(model).SerializeToString(), so,
                                providers=["CPUExecutionProvider"])


def test_kernel_takes_its_strided_path_when_run_time_shapes_differ_from_the_static_ones():
    session = _kernel_model([128, 256], [128, 256])  # generated for full reads of both inputs
    x, y = np.random.randn(128, 256).astype(np.float32), np.random.randn(1, 256).astype(np.float32)
    np.testing.assert_allclose(session.run(None, {"x": x, "y": y})[0], x * y + x, rtol=1e-6)


@pytest.mark.parametrize("x_shape, y_shape, fed", [
    ([8, 144, 4, 4], [1, 144, 1, 1], None),            # a per-channel scale over 4 x 4 planes: rows of 16
    ([8, 144, 4, 4], [8, 144, 1, 1], None),            # squeeze-and-excitation: per image and channel
    ([8, 1, 4, 4], [1, 144, 1, 1], None),              # both broadcast, over different axes
    ([8, 144, 4, 4], [1, 144, 1, 4], None),            # a row's last axis read, its plane not: no merge
    ([8, 144, 4, 4], [1, 144, 1, 1], ([6, 144, 3, 5], [6, 144, 1, 5])),  # other shapes at run time
])
def test_short_rows_that_every_input_reads_alike_run_as_one_row_with_the_same_values(x_shape, y_shape, fed):
    """A kernel iterates rows of the last axis, each with an offset per input from the strides:
    over 4 x 4 planes (EfficientNet's last stages, ResNet's at 64 x 64 images) a row's setup
    cost more than its lanes (a batch norm and SiLU over 8 x 144 x 4 x 4: 0.42 ms). The last axes
    that every input reads alike now run as one row. Values as numpy's, also for run-time shapes
    whose axes do not merge."""
    session = _kernel_model(x_shape, y_shape)
    rng = np.random.default_rng(0)
    x_fed, y_fed = fed or (x_shape, y_shape)
    x, y = rng.standard_normal(x_fed).astype(np.float32), rng.standard_normal(y_fed).astype(np.float32)
    np.testing.assert_allclose(session.run(None, {"x": x, "y": y})[0], x * y + x, rtol=1e-6)


def _merges_short_rows(build, shape) -> bool:
    """The ``merges`` field of the one kernel ``build`` (as ``_kernel_model`` takes it) makes."""
    x = ir.Value(name="x", shape=ir.Shape(shape), type=ir.TensorType(ir.DataType.FLOAT))
    y = ir.Value(name="y", shape=ir.Shape([1, shape[1], 1, 1]), type=ir.TensorType(ir.DataType.FLOAT))
    nodes = build(x, y)
    graph = ir.Graph([x, y], [nodes[-1].outputs[0]], nodes=nodes, opset_imports={"": 18})
    [kernel] = _pointwise.fuse_pointwise(ir.Model(graph, ir_version=10))
    return kernel.rsplit("PW_KERNEL(", 1)[1].rstrip().rstrip(");").rsplit(",", 1)[1].strip() == "1"


def test_only_kernels_whose_lanes_stand_alone_merge_short_rows():
    def scaled(x, y):
        mul = ir.node("Mul", [x, y])
        return [mul, ir.node("Add", [mul.outputs[0], x])]

    def row_sum(x, y):  # a sum over the last axis: its rows are the reduction's
        axes = ir.Value(name="axes", const_value=ir.tensor(np.array([-1], dtype=np.int64)),
                        shape=ir.Shape([1]), type=ir.TensorType(ir.DataType.INT64))
        mul = ir.node("Mul", [x, y])
        return [mul, ir.node("ReduceSum", [mul.outputs[0], axes], attributes={"keepdims": 1})]

    assert _merges_short_rows(scaled, [8, 144, 4, 4])
    assert not _merges_short_rows(row_sum, [8, 144, 4, 4])


def test_kernel_rejects_shapes_that_do_not_broadcast_with_a_clear_error():
    session = _kernel_model([128, 256], [128, 256])
    x, y = np.ones((2, 3), np.float32), np.ones((4, 3), np.float32)
    with pytest.raises(Exception, match="input shapes do not broadcast"):
        session.run(None, {"x": x, "y": y})


def test_kernel_library_is_built_once_and_reused_from_disk(tmp_path):
    first = _kernels.library([], str(tmp_path))
    assert first.startswith(str(tmp_path / "kernels"))
    mtime = os.path.getmtime(first)
    assert _kernels.library([], str(tmp_path)) == first
    assert os.path.getmtime(first) == mtime


def test_without_a_compiler_training_runs_on_ort_kernels(monkeypatch, tmp_path):
    monkeypatch.setattr(_kernels, "available", lambda: False)
    torch.manual_seed(0)
    _step(_SwiGluAttention(), torch.randn(4, 64, 64), {}, tmp_path)
    assert ort_dynamo.report().kernels == 0
    assert not any(_pointwise_nodes(p) for p in glob.glob(str(tmp_path / "*.onnx")))


def test_missing_compiler_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(_kernels, "_compiler", lambda: None)
    with pytest.raises(_kernels.KernelBuildError, match="no C compiler"):
        _kernels.library([], "")


def test_row_sums_and_softmax_fuse_with_their_neighbours_and_match_eager(tmp_path):
    """Softmax's max/exp/sum and a norm's sum over the last axis are phases of one kernel: each
    row is walked once per phase, values of earlier phases recomputed, not stored."""
    def fn(x, w):
        probs = (x * w).masked_fill(x > 2, float("-inf")).softmax(-1)
        norm = (x * x).mean(-1, keepdim=True)
        return probs * 3 - x.log_softmax(-1), x / (norm + 1e-5), norm

    x = torch.randn(8, 32, 128, requires_grad=True)
    w = torch.randn(128, requires_grad=True)
    got = _step_fn(fn, x, w, tmp_path)
    want = _step_fn(fn, x, w)
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5 * e.abs().max().item())
    forward = glob.glob(str(tmp_path / "*forward*.onnx"))[0]
    fused = "|".join(n.doc_string for n in _pointwise_nodes(forward))
    assert "ReduceMax" in fused and "ReduceSum" in fused and "ReduceMean" in fused
    assert not [n for n in onnx.load(forward).graph.node if n.op_type in ("Softmax", "LogSoftmax")]


def _softmax_kernel_session():
    """``x * Softmax(x)`` over rows of [64, 256], after the pointwise stage: the kernel's C code
    and a session."""
    x = ir.Value(name="x", shape=ir.Shape([64, 256]), type=ir.TensorType(ir.DataType.FLOAT))
    softmax = ir.node("Softmax", [x], attributes={"axis": -1})
    node = ir.node("Mul", [x, softmax.outputs[0]])
    node.outputs[0].name, node.outputs[0].dtype = "y", ir.DataType.FLOAT
    model = ir.Model(ir.Graph([x], node.outputs, nodes=[softmax, node], opset_imports={"": 18}), ir_version=10)
    kernels = []
    _, session = _after_pointwise_stage(model, kernels)
    (kernel,) = kernels
    return kernel, session


def test_softmax_kernel_computes_each_exp_once_and_not_over_its_input():
    """The softmax kernel's exp, needed for the row sum and again for the result, is computed
    once and kept in the output's row. Bound over its own input (as optimizer steps bind
    outputs), where the stash would overwrite the x the result reads again, the kernel runs its
    strided version, which recomputes: the same values."""
    kernel, session = _softmax_kernel_session()
    fast = kernel[kernel.index("_fast("):kernel.index("_any(")]
    assert fast.count("pw_expf(") == 1, fast
    data = np.random.default_rng(0).standard_normal((64, 256), dtype=np.float32) * 4
    want = np.exp(data - data.max(-1, keepdims=True))
    want = data * want / want.sum(-1, keepdims=True)
    np.testing.assert_allclose(session.run(None, {"x": data})[0], want, rtol=1e-6, atol=1e-7)
    in_place = data.copy()
    value = ort.OrtValue.ortvalue_from_numpy(in_place)
    binding = session.io_binding()
    binding.bind_ortvalue_input("x", value)
    binding.bind_ortvalue_output("y", value)
    session.run_with_iobinding(binding)
    np.testing.assert_allclose(value.numpy(), want, rtol=1e-6, atol=1e-7)


def test_softmax_over_channels_and_its_gradient_are_one_kernel_each(tmp_path):
    """A softmax or log-softmax over an axis that is not the last (a segmentation loss over
    NCHW logits, channel attention): ORT's Softmax moves that axis last and back and walks rows
    as short as the channels (layer_ops seg_cross_entropy: 4 times eager), and written out it is
    five passes. Each is one TorchAxisSoftmax kernel, and so is each gradient; eager's values
    and gradients, with a NaN, a column of -inf and a masked column as eager has them."""
    def fn(x, w):
        scores = (x * w).masked_fill(x > 2.5, float("-inf"))
        return scores.softmax(1), x.log_softmax(-3) * 2, torch.log_softmax(x, 2)

    x = torch.randn(4, 12, 24, 33)
    x[0, :, 3, 4] = float("-inf")
    x[1, 5, 6, 7] = float("nan")
    w = torch.randn(12, 1, 1)
    got = _step_fn(fn, x, w, tmp_path)
    want = _step_fn(fn, x, w)
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5 * e.nan_to_num(0, 0, 0).abs().max().item(), equal_nan=True)
    forward = _ops(glob.glob(str(tmp_path / "*forward*.onnx")))
    backward = _ops(glob.glob(str(tmp_path / "*backward*.onnx")))
    assert not {"Softmax", "LogSoftmax", "Transpose", "ReduceMax"} & set(forward), forward
    assert [op.startswith("TorchAxisSoftmax_") for op in forward].count(True) == 3, forward
    assert [op.startswith("TorchAxisSoftmax_") for op in backward].count(True) == 3, backward
    assert "Exp" not in backward, backward


@pytest.mark.parametrize("loss, one_hot", [
    (dict(reduction="none"), True),
    (dict(reduction="mean", ignore_index=3), True),
    (dict(reduction="sum", weight=torch.rand(7)), False),   # class weights: g is not a plain one-hot
    (dict(label_smoothing=0.1), False),
])
def test_a_segmentation_cross_entropys_gradient_reads_the_targets_not_a_one_hot(tmp_path, loss, one_hot):
    """A cross-entropy over the classes of [N, C, H, W] logits: its gradient before the
    log-softmax's is a one-hot of the targets (a bool compare of every class and a multiply
    written out in full); the log-softmax's gradient kernel computes it from the targets where
    it reads it. Class weights and label smoothing keep the general gradient kernel. Eager's
    loss and gradient, a NaN logit and ignored targets included."""
    torch.manual_seed(0)
    x = torch.randn(4, 7, 64, 64)
    x[1, :, 2, 2] = float("nan")
    target = torch.randint(0, 7, (4, 64, 64))
    target[0, 0, :3] = loss.get("ignore_index", -100)

    def step(fn):
        leaf = x.clone().requires_grad_()
        out = F.cross_entropy(leaf, target, **loss) if fn is None else fn(leaf)
        (out * 1.5).sum().backward()
        return out.detach(), leaf.grad

    compiled = torch.compile(lambda x: F.cross_entropy(x, target, **loss), backend="ort",
                             options={"save_onnx": True, "save_path": str(tmp_path)})
    step(compiled)
    ort_dynamo.wait_for_kernels()
    for got, want in zip(step(compiled), step(None)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, equal_nan=True)
    assert ort_dynamo.report().fallback_nodes == 0
    units = "".join(open(path).read() for path in glob.glob(str(tmp_path / "*backward*.pointwise.c")))
    assert ("PW_AXIS_LOG_SOFTMAX_ONE_HOT_GRAD(" in units) == one_hot, units
    assert ("PW_AXIS_SOFTMAX(" in units) == (not one_hot), units


def test_a_classes_iota_along_another_axis_is_not_taken_for_a_one_hot():
    """A log-softmax gradient over axis 1 whose g compares an iota of the classes laid along the
    last axis: not the cross-entropy's one-hot (whose iota lies along the softmax's axis), so
    the general gradient kernel, not a failed pointwise stage."""
    def value(name, dims, dtype=ir.DataType.FLOAT):
        return ir.Value(name=name, shape=ir.Shape(dims), type=ir.TensorType(dtype))

    y, w, index = value("y", ["n", 5, 5]), value("w", ["n", 5, 5]), value("index", ["n", 5, 1], ir.DataType.INT64)
    constants = {name: ir.Value(name=name, const_value=ir.tensor(array)) for name, array in (
        ("iota", np.arange(5, dtype=np.int64)), ("hit", np.array(-1.0, np.float32)),
        ("miss", np.array(0.0, np.float32)), ("axes", np.array([1], np.int64)))}
    equal = ir.node("Equal", [constants["iota"], index])
    where = ir.node("Where", [equal.outputs[0], constants["hit"], constants["miss"]])
    g = ir.node("Mul", [where.outputs[0], w])
    g.outputs[0].shape, g.outputs[0].dtype = y.shape, ir.DataType.FLOAT
    total = ir.node("ReduceSum", [g.outputs[0], constants["axes"]], attributes={"keepdims": 1})
    exp = ir.node("Exp", [y])
    scaled = ir.node("Mul", [exp.outputs[0], total.outputs[0]])
    sub = ir.node("Sub", [g.outputs[0], scaled.outputs[0]])
    sub.outputs[0].name, sub.outputs[0].dtype = "dx", ir.DataType.FLOAT
    graph = ir.Graph([y, w, index], sub.outputs, nodes=[equal, where, g, total, exp, scaled, sub],
                     initializers=list(constants.values()), opset_imports={"": 18})
    model = ir.Model(graph, ir_version=10)
    units = _pointwise.fuse_pointwise(model)
    assert [unit for unit in units if "PW_AXIS_SOFTMAX(" in unit], units
    assert not [unit for unit in units if "ONE_HOT" in unit], units


def test_axis_softmax_kernels_name_a_wrong_shape_instead_of_reading_past_it():
    """The kernel checks at run time what the graph promised (ORT checks the static sizes it
    was given): one shape for a gradient and the softmax it differentiates."""
    x = ir.Value(name="x", shape=ir.Shape(["n", 5, "h"]), type=ir.TensorType(ir.DataType.FLOAT))
    softmax = ir.node("LogSoftmax", [x], attributes={"axis": 1})
    softmax.outputs[0].name, softmax.outputs[0].dtype, softmax.outputs[0].shape = "y", ir.DataType.FLOAT, x.shape
    g = ir.Value(name="g", shape=ir.Shape(["n", 5, "h"]), type=ir.TensorType(ir.DataType.FLOAT))
    axes = ir.Value(name="axes", const_value=ir.tensor(np.array([1], dtype=np.int64)))
    total = ir.node("ReduceSum", [g, axes], attributes={"keepdims": 1})
    exp = ir.node("Exp", [softmax.outputs[0]])
    scaled = ir.node("Mul", [exp.outputs[0], total.outputs[0]])
    sub = ir.node("Sub", [g, scaled.outputs[0]])
    sub.outputs[0].name, sub.outputs[0].dtype = "dx", ir.DataType.FLOAT
    graph = ir.Graph([x, g], [softmax.outputs[0], sub.outputs[0]], nodes=[softmax, total, exp, scaled, sub],
                     initializers=[axes], opset_imports={"": 18})
    ops, session = _after_pointwise_stage(ir.Model(graph, ir_version=10))
    assert [op.startswith("TorchAxisSoftmax_") for op in ops] == [True, True], ops
    xs, gs = np.random.randn(2, 5, 7).astype(np.float32), np.random.randn(2, 5, 7).astype(np.float32)
    y, dx = session.run(None, {"x": xs, "g": gs})
    want = torch.log_softmax(torch.from_numpy(xs), 1)
    np.testing.assert_allclose(y, want.numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(dx, gs - np.exp(y) * gs.sum(1, keepdims=True), rtol=1e-5, atol=1e-6)
    with pytest.raises(Exception, match="one shape"):
        session.run(None, {"x": xs, "g": np.zeros((2, 5, 6), np.float32)})


def test_softmax_over_channels_of_dynamic_sizes_is_one_kernel(tmp_path):
    """The same with dynamic=True (a segmentation loss over images of any size): the channels'
    count is a constant, the other sizes symbolic. ORT's LogSoftmax took 2.2 ms of SegFormer's
    27 ms step there."""
    classifier = torch.nn.Conv2d(3, 5, 1)  # a parameter's sizes are static: 5 classes

    def fn(x):
        logits = classifier(x)
        return logits.log_softmax(1) * 2, (logits * 3).softmax(1)

    ort_dynamo.reset()
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="ort", dynamic=True, options={"save_onnx": True, "save_path": str(tmp_path)})
    for size in (24, 31, 24):
        x = torch.randn(2, 3, size, size)
        x[0, :, 3, 4] = float("-inf")
        with torch.no_grad():
            outputs = compiled(x), fn(x)
        for got, want in zip(*outputs):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, equal_nan=True)
        ort_dynamo.wait_for_kernels()  # the sizes after the first run the kernels
    assert ort_dynamo.report().exports == 1, ort_dynamo.report()
    forward = glob.glob(str(tmp_path / "*inference*.onnx"))[0]
    ops = [n.op_type for n in onnx.load(forward).graph.node]
    assert not {"Softmax", "LogSoftmax", "Transpose", "ReduceMax"} & set(ops), ops
    assert [op.startswith("TorchAxisSoftmax_") for op in ops].count(True) == 2, ops


def _step_fn(fn, x, w, tmp_path=None):
    """Outputs and gradients of ``fn`` (eager when no ``tmp_path``, else ort, saving models)."""
    x, w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    if tmp_path is not None:
        ort_dynamo.reset()
        fn = torch.compile(fn, backend="ort", options={"save_onnx": True, "save_path": str(tmp_path)})
        sum(o.sin().sum() for o in fn(x, w)).backward()
        ort_dynamo.wait_for_kernels()
        x.grad = w.grad = None
    outs = fn(x, w)
    sum(o.sin().sum() for o in outs).backward()
    return [o.detach() for o in outs] + [x.grad, w.grad]


def test_row_sums_over_an_empty_last_axis_are_zero():
    def row_sum(x, y):
        axes = ir.Value(name="axes", const_value=ir.tensor(np.array([-1], dtype=np.int64)),
                        shape=ir.Shape([1]), type=ir.TensorType(ir.DataType.INT64))
        mul = ir.node("Mul", [x, y])
        return [mul, ir.node("ReduceSum", [mul.outputs[0], axes], attributes={"keepdims": 1})]

    session = _kernel_model([128, 256], [128, 256], row_sum)
    x = np.random.randn(4, 5).astype(np.float32)
    np.testing.assert_allclose(session.run(None, {"x": x, "y": x})[0], (x * x).sum(-1, keepdims=True), rtol=1e-6)
    empty = np.ones((4, 0), np.float32)
    np.testing.assert_array_equal(session.run(None, {"x": empty, "y": empty})[0], np.zeros((4, 1), np.float32))


def test_exp_is_within_two_ulp_of_eager_and_keeps_infinities_and_nan(tmp_path):
    """Kernels compute exp with pw_expf (csrc/pointwise.h): within 1 ulp of the true value,
    eager's is too, so they agree within 2 ulp; below FLT_MIN results flush to 0."""
    x = torch.linspace(-66, 63, 1 << 16)  # exp's argument: -99 .. 94.5
    x[:4] = torch.tensor([float("-inf"), float("inf"), float("nan"), 0.0])

    def fn(x):
        return (x * 1.5).exp(), torch.sigmoid(x) * 2

    compiled = torch.compile(fn, backend="ort", options={"save_onnx": True, "save_path": str(tmp_path)})
    compiled(x)
    ort_dynamo.wait_for_kernels()
    got = compiled(x)
    fused = [n.doc_string for p in glob.glob(str(tmp_path / "*.onnx")) for n in _pointwise_nodes(p)]
    # (CPU sigmoid is written out as 1 / (1 + exp(-x)) before fusion: ORT's Sigmoid kernel loses its tails)
    assert len(fused) == 1, fused  # both read x: one kernel (its op order differs between torch versions)
    assert sorted(fused[0].split("|")) == sorted("Mul|Exp|Neg|Exp|Add|Div|Mul".split("|"))
    for g, want in zip(got, fn(x)):
        torch.testing.assert_close(g, want, rtol=2.4e-7, atol=1.2e-38, equal_nan=True)


def _pending_builds(monkeypatch):
    """Kernel builds that finish when the test says so: [(kernels, future), ...]."""
    import concurrent.futures

    builds = []

    def build(kernels, cache_dir="", openmp=False):
        future = concurrent.futures.Future()
        future.openmp = openmp  # the library's flavor the session waits for
        builds.append((kernels, future))
        return future

    monkeypatch.setattr(_kernels, "build", build)
    return builds


def test_steps_run_without_the_kernels_until_the_compiler_is_done(monkeypatch):
    """The compiler's time never holds up a step: until a partition's kernels are built, its
    model without them runs; the step after they are ready uses them, and the model without
    them is let go. Same results."""
    builds = _pending_builds(monkeypatch)
    torch.manual_seed(0)
    model, x = _SwiGluAttention(), torch.randn(4, 64, 64)
    first = _step(model, x, {})
    assert builds and not any(future.done() for _, future in builds)
    sessions = ort_dynamo.report().sessions
    for kernels, future in builds:
        future.set_result(_kernels.library(kernels, "", future.openmp))
    compiled = torch.compile(model, backend="ort")
    model.zero_grad()
    out = compiled(x)
    out.square().sum().backward()
    assert ort_dynamo.report().sessions == 2 * sessions  # each partition's session, now with kernels
    pending = {id(future) for _, future in builds}
    runners = [o for o in gc.get_objects() if type(o) is OrtRunner and id(o.kernel_library) in pending]
    assert len(runners) == len(builds) and not any(runner.exported.unfused for runner in runners)
    second = [out.detach()] + [p.grad.clone() for p in model.parameters()]
    for a, b in zip(first, second):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())


@pytest.mark.parametrize("failure", ["build", "load"])
def test_kernels_that_fail_to_build_or_load_leave_the_model_without_them_running(monkeypatch, tmp_path, failure):
    builds = _pending_builds(monkeypatch)
    torch.manual_seed(0)
    model, x = _SwiGluAttention(), torch.randn(4, 64, 64)
    plain = _step(model, x, {"pointwise_kernels": False})
    ort_dynamo.reset()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="ort")
    model.zero_grad()
    compiled(x).square().sum().backward()  # compiles; the builds are pending
    (tmp_path / "kernels.so").write_bytes(b"not a shared object")
    for _, future in builds:
        if failure == "build":
            future.set_exception(_kernels.KernelBuildError("cc failed on the generated kernels"))
        else:  # built, but not a library ORT can load
            future.set_result(str(tmp_path / "kernels.so"))
    model.zero_grad()
    reason = "KernelBuildError: cc failed" if failure == "build" else "Fail: .*kernels.so"
    with pytest.warns(UserWarning, match="runs without its pointwise kernels: " + reason):
        out = compiled(x)
        out.square().sum().backward()
    assert ort_dynamo.report().kernels == 0
    for got, want in zip([out.detach()] + [p.grad for p in model.parameters()], plain):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_kernels_of_symbolic_shapes_serve_every_batch_and_sequence_length():
    """With dynamic=True the kernels are generated for symbolic dims and serve new batch sizes
    and sequence lengths, their read patterns checked at run time."""
    torch.manual_seed(0)
    model = _SwiGluAttention()
    compiled = torch.compile(model, backend="ort", dynamic=True)
    ort_dynamo.reset()
    for batch, seq in ((4, 64), (3, 48), (5, 80)):
        x = torch.randn(batch, seq, 64)
        compiled(x).square().sum().backward()  # the first call of a shape may run without kernels
        ort_dynamo.wait_for_kernels()
        model.zero_grad()
        got = compiled(x)
        got.square().sum().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        want = model(x)
        want.square().sum().backward()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
        for g, p in zip(grads, model.parameters()):
            torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-5 * p.grad.abs().max().item())
    assert ort_dynamo.report().kernels > 0


def test_kernels_build_without_glibcs_simd_math_library(monkeypatch, tmp_path):
    """Where no libmvec links (another libc, another CPU), kernels call scalar log/tanh/erf."""
    compiler, version, flags, _ = _kernels._toolchain()
    monkeypatch.setattr(_kernels, "_toolchain", lambda: (compiler, version, (*flags, "-DPW_NO_MVEC"), ("-lm",)))

    def fn(x):
        return torch.tanh(x * 2) + torch.special.erf(x).abs().log()

    x = torch.randn(64, 512)
    ort_dynamo.reset()
    compiled = torch.compile(fn, backend="ort", options={"cache_dir": str(tmp_path)})
    compiled(x)
    ort_dynamo.wait_for_kernels()
    got = compiled(x)
    assert ort_dynamo.report().kernels >= 1 and glob.glob(str(tmp_path / "kernels" / "*.so"))
    torch.testing.assert_close(got, fn(x), rtol=2e-6, atol=1e-6)



def test_the_toolchain_probe_compiles_once_per_machine_not_once_per_process(monkeypatch, tmp_path):
    """Whether libmvec links is a fact of the machine: a new process reads the answer from the
    user's kernel folder instead of compiling the probe again in its first step."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    compiler = _kernels._compiler()
    compiles = []
    run = subprocess.run
    monkeypatch.setattr(subprocess, "run", lambda command, **kwargs: compiles.append(command) or run(command, **kwargs))
    _kernels._probe.cache_clear()
    try:
        first = _kernels._probe(*compiler)
        probed = len(compiles)
        _kernels._probe.cache_clear()  # as a new process finds it
        assert _kernels._probe(*compiler) == first
    finally:
        _kernels._probe.cache_clear()
    assert probed >= 1 and len(compiles) == probed
    assert glob.glob(str(tmp_path / "ort_dynamo" / "kernels" / "toolchain_*.json"))


def test_kernels_built_for_one_cpu_are_not_loaded_on_another_sharing_the_cache(monkeypatch, tmp_path):
    """``-march=native`` objects die of an illegal instruction on an older CPU: a cache folder
    on a network drive, shared by two kinds of machine, keeps one library per CPU."""
    path = _kernels.library([], str(tmp_path))
    assert _kernels.built([], str(tmp_path)) == path
    monkeypatch.setattr(_kernels, "_target", lambda: "vendor_id : another CPU\nflags : sse sse2")
    assert _kernels.built([], str(tmp_path)) is None
    assert _kernels.library([], str(tmp_path)) != path



def test_a_kernel_folder_that_cannot_be_written_leaves_the_model_without_kernels_on_ort(tmp_path):
    """The kernels' objects go under ``<cache_dir>/kernels``; where that cannot be written the
    partition keeps running on ORT without them, and a warning says where and why."""
    (tmp_path / "kernels").write_text("a file where the kernels' folder would be")

    def fn(x):
        return torch.tanh(x * 2) + torch.special.erf(x).abs().log()

    x = torch.randn(64, 512)
    compiled = torch.compile(fn, backend="ort", options={"cache_dir": str(tmp_path), "fallback_policy": "DISABLE"})
    with pytest.warns(UserWarning, match="runs without its pointwise kernels: KernelBuildError: cannot write"):
        compiled(x)
        ort_dynamo.wait_for_kernels()
        got = compiled(x)
    torch.testing.assert_close(got, fn(x), rtol=2e-6, atol=1e-6)
    assert ort_dynamo.report().fallback_nodes == 0 and ort_dynamo.report().kernels == 0


def test_a_group_reading_another_groups_unannotated_output_is_fused_too():
    """Values inside inlined torchlib functions carry no shape; the pass infers them, and a
    later group reading one through an earlier kernel's output keeps that inferred shape."""
    x = ir.Value(name="x", shape=ir.Shape([128, 256]), type=ir.TensorType(ir.DataType.FLOAT))
    y = ir.Value(name="y", shape=ir.Shape([4, 128, 256]), type=ir.TensorType(ir.DataType.FLOAT))
    sigmoid = ir.node("Sigmoid", [x])
    silu = ir.node("Mul", [x, sigmoid.outputs[0]])  # neither output has a shape annotation
    scaled = ir.node("Mul", [silu.outputs[0], y])
    out = ir.node("Add", [scaled.outputs[0], y])
    out.outputs[0].name = "out"
    graph = ir.Graph([x, y], [out.outputs[0]], nodes=[sigmoid, silu, scaled, out], opset_imports={"": 18})
    model = ir.Model(graph, ir_version=10)
    kernels = _pointwise.fuse_pointwise(model)
    assert [n.doc_string for n in model.graph] == ["Sigmoid|Mul", "Mul|Add"]
    so = ort.SessionOptions()
    so.register_custom_ops_library(_kernels.library(kernels))
    session = ort.InferenceSession(ir.serde.serialize_model(model).SerializeToString(), so,
                                   providers=["CPUExecutionProvider"])
    xv, yv = np.random.randn(128, 256).astype(np.float32), np.random.randn(4, 128, 256).astype(np.float32)
    want = (torch.nn.functional.silu(torch.from_numpy(xv)) * torch.from_numpy(yv) + torch.from_numpy(yv)).numpy()
    np.testing.assert_allclose(session.run(None, {"x": xv, "y": yv})[0], want, rtol=1e-6, atol=1e-6)


def test_a_failing_fusion_pass_leaves_the_partition_on_ort_without_kernels(monkeypatch, caplog):
    def broken(model, *args, **kwargs):
        raise RuntimeError("simulated bug in the fusion pass")

    monkeypatch.setattr(_pointwise, "fuse_pointwise", broken)
    torch.manual_seed(0)
    model, x = _SwiGluAttention(), torch.randn(4, 64, 64)
    with caplog.at_level("WARNING", logger="ort_dynamo"):
        got = _step(model, x, {})
    assert "simulated bug in the fusion pass" in caplog.text
    assert ort_dynamo.report().kernels == 0 and ort_dynamo.report().fallback_nodes == 0
    want = _step(model, x, {"pointwise_kernels": False})
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_a_max_over_rows_that_is_a_result_keeps_nan_as_torch_does():
    def fn(x):
        return (x * 2).amax(-1, keepdim=True) + 1, (x * 2).softmax(-1)

    x = torch.randn(64, 512)
    x[3, 7] = float("nan")
    compiled = torch.compile(fn, backend="ort")
    compiled(x)
    ort_dynamo.wait_for_kernels()
    for got, want in zip(compiled(x), fn(x)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, equal_nan=True)


def test_a_softmax_written_out_with_its_logsumexp_is_one_kernel_with_torchs_nan(tmp_path):
    """Attention that keeps each row's logsumexp for backward (memory_opt_level=1) writes its
    softmax out: max, exp, sum, and max + log(sum). Its max fuses into the kernel with the rest,
    without the NaN check a max that is a result needs: a row holding NaN, a row of -inf and
    a +inf give torch's values. (Here no gradient is asked for: autograd would save the max.)"""
    def fn(x, w):
        scores = (x * w).masked_fill(x > 2.5, float("-inf"))
        peak = scores.amax(-1, keepdim=True)
        exp = torch.exp(scores - peak)
        total = exp.sum(-1, keepdim=True)
        return exp / total, peak + torch.log(total)

    x = torch.randn(4, 8, 24, 40)
    x[0, 1, 2] = 3.0
    x[1, 2, 3, 4] = float("nan")
    x[2, 3, 4, 5] = float("-inf")
    w = torch.rand(8, 1, 1) + 0.5
    w[3] = -1.0  # that -inf scores +inf
    ort_dynamo.reset()
    compiled = torch.compile(fn, backend="ort", options={"save_onnx": True, "save_path": str(tmp_path)})
    compiled(x, w)
    ort_dynamo.wait_for_kernels()
    for got, want in zip(compiled(x, w), fn(x, w)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, equal_nan=True)
    assert got[0, 1, 2].isnan().all() and got[1, 2, 3].isnan().all() and got[2, 3, 4].isnan().all()
    model = glob.glob(str(tmp_path / "*.onnx"))[0]
    ops = [n.op_type for n in onnx.load(model).graph.node]
    assert "ReduceMax" not in ops and "IsNaN" not in ops and _pointwise_nodes(model), ops


def _rotate_half(x):
    """Rotary embeddings' rotation (Llama, Mistral, Qwen, GPT-NeoX)."""
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def _rotary(rotate):
    def fn(x, w):
        q = (x * w).view(x.shape[0], x.shape[1], 4, 32).transpose(1, 2)  # heads, as attention takes them
        angles = torch.arange(x.shape[1], dtype=torch.float32)[:, None] * torch.arange(16.0)[None] / 16
        angles = torch.cat([angles, angles], -1)
        return q * angles.cos() + rotate(q) * angles.sin(),

    return fn


def _ops(paths):
    return [n.op_type for path in paths for n in onnx.load(path).graph.node]


@pytest.mark.parametrize("rotate, folded", [
    (_rotate_half, True),
    (lambda x: torch.cat((x[..., 16:], x[..., :16]), -1), True),     # no sign: a roll by half
    (lambda x: torch.cat((-x[..., :16], x[..., 16:]), -1), False),   # lanes stay in place
    (lambda x: torch.cat((x[..., 8:], -x[..., :8]), -1), False),     # a roll by a quarter
])
def test_rotary_embeddings_rotate_lanes_inside_one_kernel(rotate, folded, tmp_path):
    """q * cos + rotate_half(q) * sin, forward and backward (where the rotation's gradient is
    two padded slices added), is one kernel reading q at shifted lanes: no Slice, Pad, Concat
    left. Lane moves that are not a rotation by half stay ORT ops."""
    fn = _rotary(rotate)
    x, w = torch.randn(8, 64, 128), torch.randn(128)
    got = _step_fn(fn, x, w, tmp_path)
    want = _step_fn(fn, x, w)
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5 * e.abs().max().item())
    models = glob.glob(str(tmp_path / "*.onnx"))
    fused = [n.doc_string for path in models for n in _pointwise_nodes(path)]
    if folded:
        assert len(models) == 2 and all("RotateHalf" in _ops([p]) or any(
            "RotateHalf" in n.doc_string for n in _pointwise_nodes(p)) for p in models)
        # One kernel each way: q * cos and rotate(q) * sin were two groups that the Add joins.
        assert sum("RotateHalf" in d and d.count("Mul") == 2 and "Add" in d for d in fused) == 2
        assert not {"Slice", "Split", "Pad", "Concat", "RotateHalf"} & set(_ops(models))
    else:
        assert not any("RotateHalf" in d for d in fused) and "RotateHalf" not in _ops(models)


def test_a_rotation_too_small_for_a_kernel_runs_as_ort_ops(tmp_path):
    fn = _rotary(_rotate_half)
    x, w = torch.randn(2, 4, 128), torch.randn(128)  # 1024 elements: below MIN_ELEMENTS
    got = _step_fn(fn, x, w, tmp_path)
    want = _step_fn(fn, x, w)
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5 * e.abs().max().item())
    ops = _ops(glob.glob(str(tmp_path / "*.onnx")))
    assert "RotateHalf" not in ops and "Concat" in ops


def test_rotations_serve_every_batch_and_sequence_length():
    fn = torch.compile(_rotary(_rotate_half), backend="ort", dynamic=True)
    ort_dynamo.reset()
    w = torch.randn(128, requires_grad=True)
    for batch, seq in ((8, 64), (5, 48), (3, 40)):
        x = torch.randn(batch, seq, 128, requires_grad=True)
        fn(x, w)[0].sum().backward()  # the first call of a shape may run without kernels
        ort_dynamo.wait_for_kernels()
        x.grad = w.grad = None
        got = fn(x, w)[0]
        got.sin().sum().backward()
        grads = [x.grad, w.grad]
        x.grad = w.grad = None
        want = _rotary(_rotate_half)(x, w)[0]
        want.sin().sum().backward()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for g, e in zip(grads, [x.grad, w.grad]):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5 * e.abs().max().item())
    assert ort_dynamo.report().kernels > 0 and ort_dynamo.report().fallback_nodes == 0


class _Embeddings(nn.Module):
    def __init__(self):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(1000, 256, padding_idx=3), nn.Embedding(128, 256)

    def forward(self, ids):
        return (self.tokens(ids) + self.positions(torch.arange(ids.shape[1]))).tanh()


@pytest.mark.parametrize("memory_opt_level", [0, 1])
def test_embedding_gradients_add_whole_rows_in_one_kernel(tmp_path, memory_opt_level):
    """An embedding's gradient (a scatter-add of rows, repeated and padding ids included) is one
    ScatterAddRows kernel, not ORT's per-element ScatterElements, with eager's gradients; it
    adds into zeros it makes itself (ScatterAddRowsToZeros), no zeros tensor of the graph.
    At level 1 backward recomputes the positions (``arange``): their index is a constant."""
    torch.manual_seed(0)
    model, ids = _Embeddings(), torch.randint(0, 1000, (8, 128))
    ids[0, :5], ids[1] = 3, 7  # padding, and one id 128 times
    got = _step(model, ids, {"memory_opt_level": memory_opt_level}, tmp_path)
    model.zero_grad()
    model(ids).square().sum().backward()
    for g, p in zip(got[1:], model.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-6 * p.grad.abs().max().item())
    backward = glob.glob(str(tmp_path / "*backward*.onnx"))
    ops = _ops(backward)
    assert ops.count("ScatterAddRowsToZeros") == 2 and "ScatterElements" not in ops


def _scatter_session(into_zeros: bool):
    """ScatterElements(data, Expand(index), updates) fused; ``into_zeros``: data is a
    ConstantOfShape of 0 (which ORT would fold into an initializer), not a graph input."""
    index = ir.Value(name="index", shape=ir.Shape([5, 1]), type=ir.TensorType(ir.DataType.INT64))
    updates = ir.Value(name="updates", shape=ir.Shape([5, 4]), type=ir.TensorType(ir.DataType.FLOAT))
    shape = ir.Value(name="shape", const_value=ir.tensor(np.array([5, 4], dtype=np.int64)))
    data_shape = ir.Value(name="data_shape", const_value=ir.tensor(np.array([6, 4], dtype=np.int64)))
    expand = ir.node("Expand", [index, shape])
    expand.outputs[0].shape, expand.outputs[0].dtype = ir.Shape([5, 4]), ir.DataType.INT64
    nodes, inputs = [expand], [index, updates]
    if into_zeros:
        nodes.insert(0, ir.node("ConstantOfShape", [data_shape]))
        data = nodes[0].outputs[0]
    else:
        data = ir.Value(name="data", type=ir.TensorType(ir.DataType.FLOAT))
        inputs.insert(0, data)
    data.shape, data.dtype = ir.Shape([6, 4]), ir.DataType.FLOAT
    scatter = ir.node("ScatterElements", [data, expand.outputs[0], updates], attributes={"axis": 0, "reduction": "add"})
    scatter.outputs[0].name = "out"
    graph = ir.Graph(inputs, scatter.outputs, nodes=[*nodes, scatter], initializers=[shape, data_shape],
                     opset_imports={"": 18})
    model = ir.Model(graph, ir_version=10)
    kernels = _pointwise.fuse_pointwise(model)
    assert [_pointwise.kernel_name(k) for k in kernels] == ["ScatterAddRowsToZeros" if into_zeros else "ScatterAddRows"]
    assert "ConstantOfShape" not in [node.op_type for node in model.graph]
    so = ort.SessionOptions()
    so.register_custom_ops_library(_kernels.library(kernels))
    return ort.InferenceSession(ir.serde.serialize_model(model).SerializeToString(), so,
                                providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("into_zeros", [False, True])
def test_scatter_add_rows_follows_onnx_and_rejects_indices_out_of_range(into_zeros):
    session = _scatter_session(into_zeros)
    data, updates = np.random.randn(6, 4).astype(np.float32), np.random.randn(5, 4).astype(np.float32)
    if into_zeros:
        data[:] = 0.0
    feeds = {"updates": updates} if into_zeros else {"data": data, "updates": updates}
    index = np.array([[0], [5], [-1], [2], [0]], dtype=np.int64)  # repeated, and negative as ONNX allows
    want = data.copy()
    for r, i in enumerate(index[:, 0]):
        want[i] += updates[r]
    np.testing.assert_allclose(session.run(None, {**feeds, "index": index})[0], want, rtol=1e-6)
    with pytest.raises(Exception, match="ScatterAddRows(ToZeros)?: index out of range"):
        session.run(None, {**feeds, "index": np.array([[0], [6], [1], [1], [1]])})


def test_a_log_of_the_row_sum_is_computed_in_the_kernel_that_sums(tmp_path):
    """LogSoftmax's ``x - max - log(sum)``: the log of each row's sum joins the kernel that
    computes the sum, so the shifted rows are never written out for a separate Sub. A log
    of the sum that is read elsewhere too is left to ORT, from the kernel's row sums."""

    def log_softmax(x):
        return torch.log_softmax(x * 2, -1)

    def log_read_elsewhere(x):
        y = x * 2
        total = y.exp().sum(-1, keepdim=True)
        return y - total.log(), total.log() * 3

    x = torch.randn(64, 512)
    for fn, fused in ((log_softmax, ["Mul|ReduceMax|Sub|Exp|ReduceSum|Log|Sub"]),
                      (log_read_elsewhere, ["Mul|Exp|ReduceSum|Log|Sub"])):
        folder = tmp_path / fn.__name__
        ort_dynamo.reset()
        compiled = torch.compile(fn, backend="ort", options={"save_onnx": True, "save_path": str(folder)})
        compiled(x)
        ort_dynamo.wait_for_kernels()
        got, want = compiled(x), fn(x)
        for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
        (path,) = glob.glob(str(folder / "*.onnx"))
        assert [n.doc_string for n in _pointwise_nodes(path)] == fused
        assert "Sub" not in [n.op_type for n in onnx.load(path).graph.node]


def test_a_view_between_elementwise_ops_does_not_split_their_kernel():
    """The loss's gradient ([tokens, vocab]) is viewed as [batch, seq, vocab], added to the
    logits' own gradient and summed for the bias: one kernel, which never writes the loss's
    gradient out; the Add is moved before the view, the other operand viewed alike."""
    a = ir.Value(name="a", shape=ir.Shape([128, 256]), type=ir.TensorType(ir.DataType.FLOAT))
    t = ir.Value(name="t", shape=ir.Shape([4, 32, 256]), type=ir.TensorType(ir.DataType.FLOAT))
    shape = ir.Value(name="shape", const_value=ir.tensor(np.array([4, 32, 256], dtype=np.int64)))
    flat = ir.Value(name="flat", const_value=ir.tensor(np.array([128, 256], dtype=np.int64)))
    axes = ir.Value(name="axes", const_value=ir.tensor(np.array([0, 1], dtype=np.int64)))
    grad = ir.node("Mul", [a, a])
    view = ir.node("Reshape", [grad.outputs[0], shape])
    view.outputs[0].shape, view.outputs[0].dtype = ir.Shape([4, 32, 256]), ir.DataType.FLOAT
    add = ir.node("Add", [view.outputs[0], t])
    bias = ir.node("ReduceSum", [add.outputs[0], axes], attributes={"keepdims": 0})
    rows = ir.node("Reshape", [add.outputs[0], flat])  # as the MatMul after it reads the sum
    rows.outputs[0].shape, rows.outputs[0].dtype = ir.Shape([128, 256]), ir.DataType.FLOAT
    rows.outputs[0].name, bias.outputs[0].name = "rows", "bias"
    bias.outputs[0].shape, bias.outputs[0].dtype = ir.Shape([256]), ir.DataType.FLOAT
    graph = ir.Graph([a, t], [rows.outputs[0], bias.outputs[0]], nodes=[grad, view, add, bias, rows],
                     initializers=[shape, flat, axes], opset_imports={"": 18})
    model = ir.Model(graph, ir_version=10)
    kernels = _pointwise.fuse_pointwise(model)
    assert [n.doc_string for n in model.graph if n.domain == _pointwise.DOMAIN] == ["Mul|Add|ReduceSum"]
    so = ort.SessionOptions()
    so.register_custom_ops_library(_kernels.library(kernels))
    session = ort.InferenceSession(ir.serde.serialize_model(model).SerializeToString(), so,
                                   providers=["CPUExecutionProvider"])
    av, tv = np.random.randn(128, 256).astype(np.float32), np.random.randn(4, 32, 256).astype(np.float32)
    got_rows, got_bias = session.run(None, {"a": av, "t": tv})
    want = (av * av).reshape(4, 32, 256) + tv
    np.testing.assert_allclose(got_rows, want.reshape(128, 256), rtol=1e-6)
    np.testing.assert_allclose(got_bias, want.sum((0, 1)), rtol=1e-5)


class _DenseBlock(nn.Module):
    """Bias and LayerNorm-weight gradients: sums over every token of the rows a kernel makes."""

    def __init__(self):
        super().__init__()
        self.up, self.norm, self.down = nn.Linear(64, 128), nn.LayerNorm(128), nn.Linear(128, 64)

    def forward(self, x):
        return self.down(nn.functional.gelu(self.norm(self.up(x))))


def test_column_sums_are_added_up_in_the_kernel_that_makes_their_rows(tmp_path):
    torch.manual_seed(0)
    model, x = _DenseBlock(), torch.randn(8, 64, 64)
    fused = _step(model, x, {}, tmp_path)
    plain = _step(model, x, {"pointwise_kernels": False})
    model.zero_grad()
    model(x).square().sum().backward()
    eager = [p.grad for p in model.parameters()]
    for got, unfused, want in zip(fused[1:], plain[1:], eager):
        torch.testing.assert_close(got, unfused, rtol=1e-5, atol=1e-5 * unfused.abs().max().item())
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    backward = glob.glob(str(tmp_path / "*backward*.onnx"))
    assert "ReduceSum" not in _ops(backward)  # through the Reshape to [tokens, features] too
    fused_ops = [n.doc_string for path in backward for n in _pointwise_nodes(path)]
    assert any("Erf" in d and "ReduceSum" in d for d in fused_ops)  # GELU backward and a bias gradient


def _column_sum_session(keepdims):
    x = ir.Value(name="x", shape=ir.Shape(["rows", 256]), type=ir.TensorType(ir.DataType.FLOAT))
    axes = ir.Value(name="axes", const_value=ir.tensor(np.array([0], dtype=np.int64)))
    scaled = ir.node("Mul", [x, x])
    total = ir.node("ReduceSum", [scaled.outputs[0], axes], attributes={"keepdims": keepdims})
    scaled.outputs[0].name, total.outputs[0].name = "squares", "total"
    graph = ir.Graph([x], [scaled.outputs[0], total.outputs[0]], nodes=[scaled, total], initializers=[axes],
                     opset_imports={"": 18})
    model = ir.Model(graph, ir_version=10)
    kernels = _pointwise.fuse_pointwise(model)
    assert len(kernels) == 1 and [n.doc_string for n in model.graph] == ["Mul|ReduceSum"]
    so = ort.SessionOptions()
    so.register_custom_ops_library(_kernels.library(kernels))
    return ort.InferenceSession(ir.serde.serialize_model(model).SerializeToString(), so,
                                providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("keepdims", [0, 1])
def test_column_sums_of_any_row_count_including_none(keepdims):
    session = _column_sum_session(keepdims)
    for rows in (0, 1, 7, 3000):  # 3000 rows: many tasks, whose partial sums are added in order
        x = np.random.randn(rows, 256).astype(np.float32)
        squares, total = session.run(None, {"x": x})
        want = (x.astype(np.float64) ** 2).sum(0, keepdims=bool(keepdims))
        assert total.shape == want.shape
        np.testing.assert_allclose(squares, x * x, rtol=1e-6)
        np.testing.assert_allclose(total, want, rtol=1e-5, atol=1e-6)
        runs = [session.run(None, {"x": x})[1] for _ in range(3)]
        assert all(np.array_equal(r, total) for r in runs)  # the same sums every run


def test_a_kernel_with_two_column_sums_keeps_each_in_its_own_partial_rows():
    """A LayerNorm backward's kernel writes its weight's and its bias's gradients: two column sums
    beside full outputs. Each column sum gets its own block of per-task partial rows."""
    x = ir.Value(name="x", shape=ir.Shape(["rows", 256]), type=ir.TensorType(ir.DataType.FLOAT))
    axes = ir.Value(name="axes", const_value=ir.tensor(np.array([0], dtype=np.int64)))
    sums = ir.node("ReduceSum", [x, axes], attributes={"keepdims": 0})
    scaled = ir.node("Mul", [x, x])
    total = ir.node("ReduceSum", [scaled.outputs[0], axes], attributes={"keepdims": 0})
    sums.outputs[0].name, scaled.outputs[0].name, total.outputs[0].name = "sums", "squares", "total"
    graph = ir.Graph([x], [sums.outputs[0], scaled.outputs[0], total.outputs[0]], nodes=[sums, scaled, total],
                     initializers=[axes], opset_imports={"": 18})
    model = ir.Model(graph, ir_version=10)
    kernels = _pointwise.fuse_pointwise(model)
    assert [n.doc_string for n in model.graph] == ["ReduceSum|Mul|ReduceSum"]  # one kernel, three outputs
    so = ort.SessionOptions()
    so.register_custom_ops_library(_kernels.library(kernels))
    session = ort.InferenceSession(ir.serde.serialize_model(model).SerializeToString(), so,
                                   providers=["CPUExecutionProvider"])
    x = np.random.randn(3000, 256).astype(np.float32)  # many tasks
    got_sums, squares, got_total = session.run(None, {"x": x})
    np.testing.assert_allclose(got_sums, x.astype(np.float64).sum(0), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(squares, x * x, rtol=1e-6)
    np.testing.assert_allclose(got_total, (x.astype(np.float64) ** 2).sum(0), rtol=1e-5, atol=1e-4)


def test_kernels_read_and_write_through_transposes(tmp_path):
    """Attention heads' transposes around elementwise work are strides of the kernel: read in
    place (keeping the last axis: strided rows; moving it: strided lanes), written in place
    (keeping the last axis), with symbolic batch and sequence sizes."""
    def fn(x, y):
        q = x.transpose(1, 2)  # [B, H, S, D]
        k = y.transpose(-1, -2)  # [B, H, S, D] read across y's last axis
        out = (q.exp() * k + q).transpose(1, 2)  # back to [B, S, H, D]
        return out.reshape(out.shape[0], out.shape[1], -1),

    ort_dynamo.reset()
    compiled = torch.compile(fn, backend="ort", dynamic=True,
                             options={"save_onnx": True, "save_path": str(tmp_path)})
    for batch, seq in ((8, 64), (3, 48)):
        x, y = torch.randn(batch, seq, 4, 32), torch.randn(batch, 4, 32, seq)
        compiled(x, y)
        ort_dynamo.wait_for_kernels()
        # Against float64: eager's float32 exp of the transposed q is off by up to 5e-4 in one
        # of its two threads' halves (torch 2.13 CPU), ours by 3e-7.
        torch.testing.assert_close(compiled(x, y)[0], fn(x.double(), y.double())[0].float(), rtol=1e-6, atol=1e-6)
    models = glob.glob(str(tmp_path / "*.onnx"))
    assert models and all(len(_pointwise_nodes(p)) == 1 for p in models) and "Transpose" not in _ops(models)
    code = "".join(open(p).read() for p in glob.glob(str(tmp_path / "*.pointwise.c")))
    assert "PW_STRIDED_ROW" in code and "PW_GENERAL" in code and "pw_out_offset" in code


def test_an_identity_permute_after_a_chain_keeps_its_kernel_flat(tmp_path):
    """``unfold``'s backward permutes its gradient to the same order: the kernel writes it as it
    is and runs flat, in blocks, not row by row along a last axis of 4 (7.6 ms against 0.65 at
    8 x 64 x 2047 x 4: benchmarks/layer_ops.py unfold_overlap)."""
    ort_dynamo.reset()
    x = torch.randn(4, 16, 1024, requires_grad=True)  # large enough for kernels
    compiled = torch.compile(lambda t: (t.unfold(-1, 4, 2) * 1.5).square().sum(), backend="ort",
                             options={"save_onnx": True, "save_path": str(tmp_path)})
    compiled(x).backward()
    ort_dynamo.wait_for_kernels()
    want = x.detach().clone().requires_grad_()
    (want.unfold(-1, 4, 2) * 1.5).square().sum().backward()
    x.grad = None
    compiled(x).backward()
    torch.testing.assert_close(x.grad, want.grad)
    code = open(glob.glob(str(tmp_path / "*backward*.pointwise.c"))[0]).read()
    definition = next(line for line in code.splitlines() if line.startswith("PW_KERNEL("))
    assert "_perms" not in definition and definition.split(", ")[7] == "1", definition  # flat


def test_groups_joined_through_another_op_stay_two_kernels():
    """A node reading two groups merges them into one kernel, except when one group reaches
    the other through an op outside both (here a matmul): one kernel would then feed itself."""
    def fn(x, w):
        a = (x * 2.0).sigmoid()
        b = (a @ w).tanh() * 3.0
        return a * b + 1.0, (x.exp() * x).sin() + x.cos()  # the second: two groups merged

    x, w = torch.randn(8, 64, 64), torch.randn(64, 64)
    ort_dynamo.reset()
    compiled = torch.compile(fn, backend="ort")
    compiled(x, w)
    ort_dynamo.wait_for_kernels()
    for got, want in zip(compiled(x, w), fn(x, w)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert ort_dynamo.report().kernels >= 2 and ort_dynamo.report().fallback_nodes == 0


def test_saving_models_whose_kernels_fail_to_build_still_trains(monkeypatch, tmp_path):
    """With save_onnx the library is built at once, to be written beside the model: its failure
    is a warning there too (the partition runs without kernels), not a failed compile."""
    def failing_compiler(command, cwd):
        raise _kernels.KernelBuildError("cc failed on the generated kernels")

    monkeypatch.setattr(_kernels, "_run", failing_compiler)
    torch.manual_seed(0)
    model, x = _SwiGluAttention(), torch.randn(4, 64, 64)
    plain = _step(model, x, {"pointwise_kernels": False})
    ort_dynamo.reset()
    torch._dynamo.reset()
    options = {"save_onnx": True, "save_path": str(tmp_path / "saved"), "cache_dir": str(tmp_path / "cache")}
    compiled = torch.compile(model, backend="ort", options=options)
    model.zero_grad()
    with pytest.warns(UserWarning, match="runs without its pointwise kernels: KernelBuildError: cc failed"):
        out = compiled(x)
        out.square().sum().backward()
        ort_dynamo.wait_for_kernels()
        model.zero_grad()
        out = compiled(x)
        out.square().sum().backward()
    assert glob.glob(str(tmp_path / "saved" / "*.pointwise.c")) and not glob.glob(str(tmp_path / "saved" / "*.so"))
    for got, want in zip([out.detach()] + [p.grad for p in model.parameters()], plain):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_kernel_with_many_inputs_and_outputs_is_vectorized(tmp_path):
    """Eight inputs, four outputs (a LayerNorm backward's size). Unless told the lanes are
    independent, gcc checks each input/output pair for overlap at run time and, past about
    ten pairs, leaves the loop scalar: 2-3x slower (BERT's norm gradients, optimizer steps)."""
    compiler, version, flags, _ = _kernels._toolchain()
    if "clang" in version.lower():
        pytest.skip(f"the vectorizer report read here is gcc's; the compiler is {version}")
    xs = [ir.Value(name=f"x{i}", shape=ir.Shape([64, 256]), type=ir.TensorType(ir.DataType.FLOAT))
          for i in range(8)]
    nodes, outputs, last = [], [], xs[0]
    for j in range(4):  # out_j = (out_{j-1} * x_2j+1) + x_2j+2: one chain, four results
        nodes.append(ir.node("Mul", [last, xs[2 * j + 1]]))
        nodes.append(ir.node("Add", [nodes[-1].outputs[0], xs[(2 * j + 2) % 8]]))
        last = nodes[-1].outputs[0]
        last.name = f"out{j}"
        outputs.append(last)
    model = ir.Model(ir.Graph(xs, outputs, nodes=nodes, opset_imports={"": 18}), ir_version=10)
    (kernel,) = _pointwise.fuse_pointwise(model)
    source = tmp_path / "kernel.c"
    source.write_text(kernel)
    report = subprocess.run([compiler, *flags, "-c", "-I", _kernels._CSRC, str(source), "-o", str(tmp_path / "k.o"),
                             "-fopt-info-vec-optimized"], capture_output=True, text=True, check=True).stderr
    fast_lines = kernel.split("PW_RARELY")[0].count("\n")
    vectorized = {int(line.split(":")[1]) for line in report.splitlines() if "loop vectorized" in line}
    assert any(line <= fast_lines for line in vectorized), report


def test_kernels_use_512_bit_vectors_where_the_cpu_has_avx512(tmp_path):
    """GCC and clang vectorize 256 bits wide for Intel's AVX-512 CPUs unless told otherwise:
    there a GELU backward (erf, exp) ran at half speed. The kernels' flags ask for 512."""
    compiler, _, flags, _ = _kernels._toolchain()
    if "__AVX512F__" not in _kernels._macros(compiler, flags):
        pytest.skip("the kernels' target has no AVX-512")
    x = ir.Value(name="x", shape=ir.Shape([64, 1024]), type=ir.TensorType(ir.DataType.FLOAT))
    erf = ir.node("Erf", [x])
    exp = ir.node("Exp", [erf.outputs[0]])
    exp.outputs[0].name = "y"
    model = ir.Model(ir.Graph([x], [exp.outputs[0]], nodes=[erf, exp], opset_imports={"": 18}), ir_version=10)
    (kernel,) = _pointwise.fuse_pointwise(model)
    source = tmp_path / "kernel.c"
    source.write_text(kernel)
    assembly = subprocess.run([compiler, *flags, "-S", "-I", _kernels._CSRC, str(source), "-o", "-"],
                              capture_output=True, text=True, check=True).stdout
    fast = assembly.split("_fast:")[1].split(".size")[0]
    assert "%zmm" in fast, f"the kernel's loop is not 512 bits wide with {flags}"


def test_chains_that_read_the_same_tensor_share_one_kernel_unless_one_feeds_the_other(tmp_path):
    """SwiGLU's backward reads the product's gradient for both factors: one kernel reads it
    once. A chain that also reads, through a MatMul, what the other computes must run after
    it: two kernels."""
    x, y, w = torch.randn(128, 256), torch.randn(128, 256), torch.randn(256, 256) / 16

    def siblings(x, y):
        return (x * y).exp(), (x + y).sigmoid()

    def dependent(x, w):
        m = (x * 0.5).exp() @ w
        return (x * m).exp()

    for fn, args, kernels in ((siblings, (x, y), 1), (dependent, (x, w), 2)):
        folder = tmp_path / fn.__name__
        compiled = torch.compile(fn, backend="ort", options={"save_onnx": True, "save_path": str(folder)})
        compiled(*args)
        ort_dynamo.wait_for_kernels()
        got = compiled(*args)
        fused = [n.doc_string for p in glob.glob(str(folder / "*.onnx")) for n in _pointwise_nodes(p)]
        assert len(fused) == kernels, fused
        want = fn(*args)
        for g, w_ in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            torch.testing.assert_close(g, w_, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("approximate, ort_op, function", [("none", "Gelu", "Erf"), ("tanh", "FastGelu", "Tanh")])
def test_a_gelu_recomputed_in_backward_shares_its_backwards_kernel_and_erf(tmp_path, approximate, ort_op, function):
    """At memory_opt_level=1 backward recomputes a GELU for the next Linear's weight gradient.
    It is computed in the kernel of the GELU's own gradient, from the same erf (tanh for the
    tanh approximation, GPT-2's), not by ORT's Gelu (FastGelu), a pass of its own: the kernel
    has one Erf (Tanh) and two full outputs."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(approximate=approximate), nn.Linear(256, 64))
    x = torch.randn(128, 64)
    model(x).square().sum().backward()
    want = [p.grad.clone() for p in model.parameters()]
    got = _step(model, x, {"memory_opt_level": 1}, tmp_path)
    forward = [n for p in glob.glob(str(tmp_path / "*forward*.onnx")) for n in onnx.load(p).graph.node]
    assert [n.op_type for n in forward].count(ort_op) == 1  # the forward's GELU is ORT's
    backward = [n for p in glob.glob(str(tmp_path / "*backward*.onnx")) for n in onnx.load(p).graph.node]
    assert not [n for n in backward if n.op_type == ort_op], f"recomputed by ORT's {ort_op}"
    gelu_kernels = [n for n in backward if n.domain == _pointwise.DOMAIN and function in n.doc_string.split("|")]
    assert len(gelu_kernels) == 1 and gelu_kernels[0].doc_string.split("|").count(function) == 1, \
        [n.doc_string for n in gelu_kernels]
    assert len(gelu_kernels[0].output) >= 2  # the recomputed GELU and the gradient through it
    for name, g, w in zip(("w1", "b1", "w2", "b2"), got[1:], want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5 * w.abs().max().item(), msg=name)


@pytest.mark.parametrize("approximate, ort_op, function", [("none", "Gelu", "Erf"), ("tanh", "FastGelu", "Tanh")])
def test_a_gelu_after_its_linears_bias_is_one_kernel_with_the_bias_add(tmp_path, approximate, ort_op, function):
    """A 3-D Linear's bias is added after its view; the GELU after it is computed in that add's
    kernel (one pass, writing the sum autograd saves and the GELU), not by ORT's Add and then its
    Gelu (FastGelu). Eager's gradients."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(approximate=approximate), nn.Linear(256, 64))
    x = torch.randn(4, 64, 64)
    model(x).square().sum().backward()
    want = [p.grad.clone() for p in model.parameters()]
    got = _step(model, x, {}, tmp_path)
    forward = [n for p in glob.glob(str(tmp_path / "*forward*.onnx")) for n in onnx.load(p).graph.node]
    assert not [n for n in forward if n.op_type == ort_op], [n.op_type for n in forward]
    gelu_kernels = [n for n in forward if n.domain == _pointwise.DOMAIN and function in n.doc_string.split("|")]
    assert len(gelu_kernels) == 1 and "Add" in gelu_kernels[0].doc_string.split("|"), \
        [n.doc_string for n in gelu_kernels]
    assert len(gelu_kernels[0].output) == 2  # the biased sum (saved for backward) and the GELU
    torch.testing.assert_close(got[0], model(x).detach(), rtol=1e-5, atol=1e-5)
    for name, g, w in zip(("w1", "b1", "w2", "b2"), got[1:], want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5 * w.abs().max().item(), msg=name)


def test_a_constant_row_index_that_does_not_cover_whole_rows_leaves_no_initializer_behind():
    """A constant index that repeats one id per row, but whose rows are narrower than the
    data's: not an embedding gradient, so ORT's ScatterElements stays, and the per-row column
    the pass made to check it does not stay in the model."""
    data = ir.Value(name="data", shape=ir.Shape([6, 4]), type=ir.TensorType(ir.DataType.FLOAT))
    updates = ir.Value(name="updates", shape=ir.Shape([5, 3]), type=ir.TensorType(ir.DataType.FLOAT))
    ids = np.repeat(np.array([[0], [2], [2], [5], [1]], dtype=np.int64), 3, axis=1)
    indices = ir.Value(name="indices", shape=ir.Shape([5, 3]), type=ir.TensorType(ir.DataType.INT64),
                       const_value=ir.tensor(ids))
    scatter = ir.node("ScatterElements", [data, indices, updates], attributes={"axis": 0, "reduction": "add"})
    graph = ir.Graph([data, updates], scatter.outputs, nodes=[scatter], initializers=[indices],
                     opset_imports={"": 18})
    assert _pointwise._scatter_add_rows(graph, _pointwise._Graph()) == []
    assert [n.op_type for n in graph] == ["ScatterElements"]
    assert list(graph.initializers) == ["indices"]


def _pooled(pool, x):
    """Values, indices and the input's gradient (through both) of ``pool(x)``."""
    x = x.detach().clone().requires_grad_(True)
    values, indices = pool(x)
    (values.nan_to_num(0.0) * torch.arange(values.numel()).reshape(values.shape)).sum().backward()
    return values.detach(), indices, x.grad


def test_max_pooling_is_one_kernel_with_torchs_values_indices_and_gradient(tmp_path):
    """Max pooling with indices is one TorchMaxPool kernel, not ORT's MaxPool with Indices (a
    generic loop, not its blocked layout: 8.5 ms for ResNet's stem) plus the lookup of
    NaNs that ORT's skips; its gradient is one ScatterAddLastAxis, not ORT's one-thread
    ScatterElements. Values, indices and gradients are torch's: the first of tied maxima (ReLU's
    zeros), the last NaN of a window, windows of -inf, padding, dilation, ceil mode, 1-, 2- and
    3-D, unbatched; adaptive pooling is the same kernel where its windows tile the input, and
    where they overlap a TorchGatheredMaxPool that reads each window in place (the portable
    chain gathers them as tiles and maps the tile indices back with a table)."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 11, 10)
    x[0, 0, :4, :4] = 0.0  # ties
    x[0, 1, 2, 3] = x[0, 1, 5, 5] = x[1, 2, 0, 0] = x[1, 2, 0, 1] = float("nan")
    x[1, 0, :, :5] = float("-inf")
    x[1, 1, 4, 4] = float("inf")
    cases = [
        lambda t: F.max_pool2d(t, 3, 2, 1, return_indices=True),
        lambda t: F.max_pool2d(t.relu(), 2, return_indices=True),
        lambda t: F.max_pool2d(t, 3, 2, dilation=2, ceil_mode=True, return_indices=True),
        lambda t: F.max_pool2d(t[0], (2, 3), (1, 2), (1, 0), return_indices=True),
        lambda t: F.max_pool1d(t.flatten(2), 4, 3, 2, ceil_mode=True, return_indices=True),
        lambda t: F.max_pool3d(t.unsqueeze(1), 2, 1, 1, return_indices=True),
        lambda t: F.adaptive_max_pool2d(t[..., :10], (11, 5), return_indices=True),
        lambda t: F.adaptive_max_pool2d(t, (4, 3), return_indices=True),  # windows that overlap
        lambda t: F.adaptive_max_pool3d(t.unsqueeze(1), (3, 4, 4), return_indices=True),
        lambda t: F.adaptive_max_pool1d(t.flatten(2)[..., :50], 7, return_indices=True),
    ]
    overlapping = {7, 8, 9}
    for index, pool in enumerate(cases):
        folder = tmp_path / str(index)
        ort_dynamo.reset()
        torch._dynamo.reset()
        compiled = torch.compile(pool, backend="ort", options={"save_onnx": True, "save_path": str(folder)})
        _pooled(compiled, x)
        ort_dynamo.wait_for_kernels()
        got, want = _pooled(compiled, x), _pooled(pool, x)
        assert ort_dynamo.report().fallback_nodes == 0
        torch.testing.assert_close(got[0], want[0], equal_nan=True, rtol=0, atol=0)
        assert torch.equal(got[1], want[1]), index
        torch.testing.assert_close(got[2], want[2], rtol=0, atol=0)
        forward, backward = _ops(glob.glob(str(folder / "*forward*.onnx"))), _ops(glob.glob(str(folder / "*backward*.onnx")))
        kernel = "TorchGatheredMaxPool_" if index in overlapping else "TorchMaxPool_"
        assert "MaxPool" not in forward and [op for op in forward if op.startswith(kernel)], forward
        if index in overlapping:  # the windows read where they are: no gathered tiles, no lookup
            assert not {"Gather", "GatherND", "Transpose", "TransposeRows"} & set(forward), forward
        assert "ScatterAddLastAxis" in backward and "ScatterElements" not in backward, backward


@pytest.mark.parametrize("layer", [
    dict(channels=6, kernel_size=7, padding=3),                              # ConvNeXt's
    dict(channels=6, kernel_size=3, padding=1, bias=False),                  # SegFormer's, MobileNet's
    dict(channels=6, kernel_size=(3, 5), stride=2, padding=(1, 2)),          # MobileNet's downsampling
    dict(channels=6, kernel_size=3, stride=(2, 1), padding=2, dilation=2),
    dict(channels=4, kernel_size=3, padding=0, groups=2, out=2),             # groups of two input channels
    dict(channels=4, kernel_size=2, stride=3, padding=1, transposed=True),   # a depthwise ConvTranspose2d
    dict(channels=4, kernel_size=3, stride=2, output_padding=1, out=8, transposed=True),  # two outputs per group
])
def test_depthwise_convolutions_and_their_gradients_are_kernels_with_eagers_results(tmp_path, layer):
    """A convolution with one output channel per group (depthwise), its input gradient (a
    grouped ConvTranspose) and its weight gradient (a batch-1 grouped Conv) are TorchGroupConv
    kernels: ORT's Conv runs them as a GEMM per (image, group), 6-8 times oneDNN's time for
    ConvNeXt's 7x7 layers. Strides, padding, dilation and input channels per group as eager."""
    layer = dict(layer)
    channels, transposed = layer.pop("channels"), layer.pop("transposed", False)
    out, groups = layer.pop("out", channels), layer.pop("groups", channels)
    torch.manual_seed(0)
    kind = nn.ConvTranspose2d if transposed else nn.Conv2d
    model = nn.Sequential(kind(channels, out, groups=groups, **{"bias": True, **layer}), nn.Tanh())
    x = torch.randn(3, channels, 11, 12)

    def results(fn):
        x.grad = None
        model.zero_grad()
        y = fn(x.requires_grad_())
        y.square().sum().backward()
        return [y.detach(), x.grad] + [p.grad.clone() for p in model.parameters()]

    want = results(model)
    compiled = torch.compile(model, backend="ort", options={"save_onnx": True, "save_path": str(tmp_path)})
    results(compiled)
    ort_dynamo.wait_for_kernels()
    got = results(compiled)
    assert ort_dynamo.report().fallback_nodes == 0
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    forward = _ops(glob.glob(str(tmp_path / "*forward*.onnx")))
    backward = _ops(glob.glob(str(tmp_path / "*backward*.onnx")))
    kernels = [op for op in forward + backward if op.startswith("TorchGroupConv_")]
    assert not {"Conv", "ConvTranspose"} & set(forward) and "ConvTranspose" not in backward, (forward, backward)
    assert len(kernels) == 3, (forward, backward)  # forward, input gradient, weight gradient


@pytest.mark.parametrize("layer", [
    dict(kernel_size=7, padding=3),                                   # ConvNeXt's
    dict(kernel_size=(3, 5), stride=2, padding=(1, 2), dilation=(2, 1)),
    dict(kernel_size=2, stride=3, padding=1, transposed=True),
])
def test_depthwise_convolutions_of_dynamic_sizes_are_kernels_that_serve_every_size(tmp_path, layer):
    """Under dynamic=True the planes (and the weight gradient's window, the output gradient's
    plane) are symbolic: the kernels read those sizes at run time, so a new image size neither
    re-exports nor leaves the convolutions to ORT's GEMM per (image, group). A row's last
    outputs, fewer than 8, are computed 8 at a time with the extra lanes dropped."""
    layer = dict(layer)
    kind = nn.ConvTranspose2d if layer.pop("transposed", False) else nn.Conv2d
    torch.manual_seed(0)
    model = nn.Sequential(kind(6, 6, groups=6, **layer), nn.Tanh())
    compiled = torch.compile(model, backend="ort", dynamic=True,
                             options={"save_onnx": True, "save_path": str(tmp_path)})

    def results(fn, x):
        x.grad = None
        model.zero_grad()
        y = fn(x.requires_grad_())
        y.square().sum().backward()
        return [y.detach(), x.grad] + [p.grad.clone() for p in model.parameters()]

    ort_dynamo.reset()
    results(compiled, torch.randn(3, 6, 11, 12))
    ort_dynamo.wait_for_kernels()
    exports = ort_dynamo.report().exports
    for x in (torch.randn(3, 6, 11, 12), torch.randn(2, 6, 16, 9), torch.randn(2, 6, 7, 5)):  # rows of 8 and less
        for got, want in zip(results(compiled, x), results(model, x)):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert ort_dynamo.report().exports == exports and ort_dynamo.report().fallback_nodes == 0
    forward = _ops(glob.glob(str(tmp_path / "*forward*.onnx")))
    backward = _ops(glob.glob(str(tmp_path / "*backward*.onnx")))
    assert not {"Conv", "ConvTranspose"} & set(forward + backward), (forward, backward)
    assert len([op for op in forward + backward if op.startswith("TorchGroupConv_")]) == 3, (forward, backward)


def test_a_depthwise_window_that_is_an_input_of_dynamic_size_is_a_kernel_too(tmp_path):
    """A weight handed in as an input (not a module's parameter) has symbolic sizes under
    dynamic=True, its window too: the input gradient's transposed convolution reads its window
    at run time as well, where ORT's ConvTranspose took 5x the step of the rest."""
    def fn(x, w):
        return torch.tanh(F.conv2d(x, w, padding=2, groups=6))

    compiled = torch.compile(fn, backend="ort", dynamic=True, options={"save_onnx": True, "save_path": str(tmp_path)})
    ort_dynamo.reset()
    torch.manual_seed(0)
    for step, (x, w) in enumerate([(torch.randn(3, 6, 11, 12), torch.randn(6, 1, 5, 5)),
                                   (torch.randn(2, 6, 9, 16), torch.randn(6, 1, 3, 3))]):
        results = []
        for f in (compiled, fn):
            inputs = [x.clone().requires_grad_(), w.clone().requires_grad_()]
            f(*inputs).square().sum().backward()
            results.append([f(*inputs).detach()] + [t.grad for t in inputs])
        if step == 0:
            ort_dynamo.wait_for_kernels()
        for got, want in zip(*results):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert ort_dynamo.report().exports == 2 and ort_dynamo.report().fallback_nodes == 0
    ops = _ops(glob.glob(str(tmp_path / "*backward*.onnx")))
    assert not {"Conv", "ConvTranspose"} & set(ops) and len([op for op in ops if op.startswith("TorchGroupConv_")]) == 2


def test_a_convolution_kernel_rejects_a_plane_of_another_size_with_a_clear_error():
    """TorchGroupConv is compiled for one plane size (its loops unroll over it): an input of
    another size, which a graph with symbolic sizes could hand it, is an error naming the
    kernel, not a read past the plane."""
    from ort_dynamo import _op_kernels

    x = ir.Value(name="x", shape=ir.Shape([2, 4, 9, 9]), type=ir.TensorType(ir.DataType.FLOAT))
    w = ir.Value(name="w", shape=ir.Shape([4, 1, 3, 3]), type=ir.TensorType(ir.DataType.FLOAT))
    conv = ir.node("Conv", [x, w], attributes={"group": 4, "pads": [1, 1, 1, 1]})
    conv.outputs[0].name, conv.outputs[0].dtype, conv.outputs[0].shape = "y", ir.DataType.FLOAT, ir.Shape([2, 4, 9, 9])
    graph = ir.Graph([x, w], conv.outputs, nodes=[conv], opset_imports={"": 18})
    kernels = _op_kernels.group_convs_as_kernels(graph)
    assert [n.op_type for n in graph] == [_pointwise.kernel_name(kernels[0])]
    graph.opset_imports[_pointwise.DOMAIN] = 1
    x.shape = ir.Shape([2, 4, "h", "w"])  # as a graph with symbolic sizes would declare it
    so = ort.SessionOptions()
    so.register_custom_ops_library(_kernels.library(kernels))
    session = ort.InferenceSession(ir.serde.serialize_model(ir.Model(graph, ir_version=10)).SerializeToString(), so,
                                   providers=["CPUExecutionProvider"])
    weights = np.random.randn(4, 1, 3, 3).astype(np.float32)
    data = np.random.randn(2, 4, 9, 9).astype(np.float32)
    want = F.conv2d(torch.from_numpy(data), torch.from_numpy(weights), padding=1, groups=4).numpy()
    np.testing.assert_allclose(session.run(None, {"x": data, "w": weights})[0], want, rtol=1e-5, atol=1e-5)
    with pytest.raises(Exception, match="TorchGroupConv_.*height and width must be those the kernel was built for"):
        session.run(None, {"x": np.zeros((2, 4, 9, 10), np.float32), "w": weights})


def test_scatter_add_along_the_last_axis_takes_zeros_of_symbolic_shape_from_their_shape():
    """Under ``dynamic=True`` the zeros a gradient scatters into are an Expand of a zero to a
    shape computed at run time (XLNet's relative attention): the kernel is handed that shape,
    and each batch size gets numpy's sums."""
    index = ir.Value(name="index", shape=ir.Shape(["n", 3]), type=ir.TensorType(ir.DataType.INT64))
    updates = ir.Value(name="updates", shape=ir.Shape(["n", 3]), type=ir.TensorType(ir.DataType.FLOAT))
    zero = ir.Value(name="zero", const_value=ir.tensor(np.array(0.0, dtype=np.float32)))
    five = ir.Value(name="five", const_value=ir.tensor(np.array([5], dtype=np.int64)))
    rows = ir.node("Shape", [updates], attributes={"end": 1})
    shape = ir.node("Concat", [rows.outputs[0], five], attributes={"axis": 0})
    zeros = ir.node("Expand", [zero, shape.outputs[0]])
    zeros.outputs[0].shape, zeros.outputs[0].dtype = ir.Shape(["n", 5]), ir.DataType.FLOAT
    scatter = ir.node("ScatterElements", [zeros.outputs[0], index, updates], attributes={"axis": 1, "reduction": "add"})
    scatter.outputs[0].name = "out"
    graph = ir.Graph([index, updates], scatter.outputs, nodes=[rows, shape, zeros, scatter],
                     initializers=[zero, five], opset_imports={"": 18})
    model = ir.Model(graph, ir_version=10)
    kernels = _pointwise.fuse_pointwise(model)
    assert [_pointwise.kernel_name(k) for k in kernels] == ["ScatterAddLastAxis"]
    assert "ScatterElements" not in [n.op_type for n in model.graph]
    so = ort.SessionOptions()
    so.register_custom_ops_library(_kernels.library(kernels))
    session = ort.InferenceSession(ir.serde.serialize_model(model).SerializeToString(), so,
                                   providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    for n in (2, 7):
        idx, values = rng.integers(-5, 5, (n, 3)), rng.standard_normal((n, 3)).astype(np.float32)
        want = np.zeros((n, 5), np.float32)
        for r in range(n):
            for j in range(3):
                want[r, idx[r, j]] += values[r, j]
        np.testing.assert_allclose(session.run(None, {"index": idx, "updates": values})[0], want, rtol=1e-6)


def test_index_select_along_the_last_axis_scatters_its_gradient_in_one_kernel_under_dynamic_shapes(tmp_path):
    """XLNet's relative shift selects along the last axis; its gradient scatter-adds into zeros
    that ``dynamic=True`` sizes at run time. One ScatterAddLastAxis for every size (was ORT's
    one-thread ScatterElements: XLNet under ``--dynamic`` 1.15x eager's step, 0.93x after)."""
    def fn(x, k):
        return torch.index_select(x, -1, torch.arange(k)).square().sum()

    compiled = torch.compile(fn, backend="ort", dynamic=True, options={"save_onnx": True, "save_path": str(tmp_path)})
    for shape in [(4, 3, 16, 32), (2, 3, 8, 20)]:
        x = torch.randn(*shape, requires_grad=True)
        torch.autograd.grad(compiled(x, shape[-1] // 2 + 1), x)
        ort_dynamo.wait_for_kernels()
        (got,) = torch.autograd.grad(compiled(x, shape[-1] // 2 + 1), x)
        (want,) = torch.autograd.grad(fn(x, shape[-1] // 2 + 1), x)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    backward = glob.glob(str(tmp_path / "*backward*.onnx"))
    assert len(backward) == 1 and "ScatterAddLastAxis" in _ops(backward) and "ScatterElements" not in _ops(backward)


def test_scatter_add_along_the_last_axis_rejects_indices_out_of_range():
    """The pooling gradient's kernel: rows of zeros, each update added at its row's index
    (repeated and negative indices as ONNX allows), and a clear error for one out of range."""
    index = ir.Value(name="index", shape=ir.Shape([2, 3]), type=ir.TensorType(ir.DataType.INT64))
    updates = ir.Value(name="updates", shape=ir.Shape([2, 3]), type=ir.TensorType(ir.DataType.FLOAT))
    zeros = ir.node("ConstantOfShape", [ir.Value(name="shape", const_value=ir.tensor(np.array([2, 5], dtype=np.int64)))])
    zeros.outputs[0].shape, zeros.outputs[0].dtype = ir.Shape([2, 5]), ir.DataType.FLOAT
    scatter = ir.node("ScatterElements", [zeros.outputs[0], index, updates], attributes={"axis": 1, "reduction": "add"})
    scatter.outputs[0].name = "out"
    graph = ir.Graph([index, updates], scatter.outputs, nodes=[zeros, scatter],
                     initializers=[zeros.inputs[0]], opset_imports={"": 18})
    model = ir.Model(graph, ir_version=10)
    kernels = _pointwise.fuse_pointwise(model)
    assert [_pointwise.kernel_name(k) for k in kernels] == ["ScatterAddLastAxis"]
    so = ort.SessionOptions()
    so.register_custom_ops_library(_kernels.library(kernels))
    session = ort.InferenceSession(ir.serde.serialize_model(model).SerializeToString(), so,
                                   providers=["CPUExecutionProvider"])
    values = np.arange(1, 7, dtype=np.float32).reshape(2, 3)
    got = session.run(None, {"index": np.array([[0, 4, 0], [-1, 2, 1]]), "updates": values})[0]
    np.testing.assert_array_equal(got, [[4, 0, 0, 0, 2], [0, 6, 5, 0, 4]])
    with pytest.raises(Exception, match="ScatterAddLastAxis: index out of range"):
        session.run(None, {"index": np.array([[0, 5, 0], [0, 0, 0]]), "updates": values})


def test_pixel_shuffle_and_its_gradient_move_rows_in_one_kernel(tmp_path):
    """Pixel shuffle (and unshuffle, its gradient) is a Transpose that moves the innermost axis;
    ORT's DepthToSpace and Transpose move such a tensor element by element on one thread
    (benchmarks/layer_ops.py pixel_shuffle: 1.80 times eager). TransposeRows gathers rows on
    the intra-op threads, with eager's values and gradients, batched or not, and under
    ``dynamic=True`` (where it was torchlib's DepthToSpace: layer_ops --dynamic 2.1x eager)."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 16, 24, 32)  # big enough for a kernel (16384 elements)
    cases = ((lambda t: F.pixel_shuffle(t, 2).sin(), x[0], False), (lambda t: F.pixel_shuffle(t, 4).sin(), x, False),
             (lambda t: F.pixel_unshuffle(t, 2).exp(), x[0], False), (lambda t: F.pixel_shuffle(t, 2).sin(), x, True),
             (lambda t: F.pixel_unshuffle(t, 2).exp(), x, True))
    for index, (fn, data, dynamic) in enumerate(cases):
        folder = tmp_path / str(index)
        ort_dynamo.reset()
        torch._dynamo.reset()
        compiled = torch.compile(fn, backend="ort", dynamic=dynamic,
                                 options={"save_onnx": True, "save_path": str(folder)})
        data = data.clone().requires_grad_(True)
        compiled(data).sum().backward()
        ort_dynamo.wait_for_kernels()
        got = compiled(data)
        (got_grad,) = torch.autograd.grad(got.square().sum(), data)
        want = fn(data)
        (want_grad,) = torch.autograd.grad(want.square().sum(), data)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got_grad, want_grad, rtol=1e-5, atol=1e-5)
        ops = _ops(glob.glob(str(folder / "*.onnx")))
        assert "TransposeRows" in ops and "Transpose" not in ops and "DepthToSpace" not in ops, ops


def _after_pointwise_stage(model: ir.Model, kernels: list | None = None):
    """``model`` through the pointwise stage: its op types, and a session with its kernels (whose
    C code is added to ``kernels`` if given)."""
    found = _pointwise.fuse_pointwise(model)
    if kernels is not None:
        kernels += found
    so = ort.SessionOptions()
    if found:
        so.register_custom_ops_library(_kernels.library(found))
    session = ort.InferenceSession(ir.serde.serialize_model(model).SerializeToString(), so,
                                   providers=["CPUExecutionProvider"])
    return [n.op_type for n in model.graph], session


def _one_transpose(dims, perm, dtype):
    """A model of one Transpose, after the pointwise stage: its op types and a session."""
    x = ir.Value(name="x", shape=ir.Shape(list(dims)), type=ir.TensorType(dtype))
    node = ir.node("Transpose", [x], attributes={"perm": list(perm)})
    node.outputs[0].name, node.outputs[0].dtype = "y", dtype
    return _after_pointwise_stage(ir.Model(ir.Graph([x], node.outputs, nodes=[node], opset_imports={"": 18}),
                                           ir_version=10))


@pytest.mark.parametrize("dims, perm, kernel", [
    ((8, 16, 2, 2, 32, 32), (0, 1, 4, 2, 5, 3), True),     # pixel shuffle
    ((4, 3, 8, 16, 8, 16), (0, 2, 4, 3, 5, 1), True),      # patches with channels last (einops)
    ((64, 32, 24), (2, 1, 0), True),                       # every axis moves
    ((64, 32, 24), (2, 0, 1), False),                      # a 2-D transpose once merged: MLAS's
    ((8, 32, 32, 2, 32, 2), (0, 2, 4, 1, 3, 5), True),     # patches: the innermost axis stays, 2 floats
    ((8, 64, 32, 2, 32, 2), (0, 1, 2, 4, 3, 5), False),    # the same, but one other axis moves: ORT's
    ((8, 128, 4, 64), (0, 2, 1, 3), False),                # attention heads: rows of 64 stay whole
    ((16, 64, 48), (0, 2, 1), True),                       # one axis moves, rows of 64: ORT writes them slowly
    ((8, 56, 56, 64), (0, 3, 1, 2), False),                # NHWC to NCHW: long rows, ORT's single-axis path
    ((8, 1, 128, 1, 64), (0, 3, 4, 1, 2), False),          # the same through sizes of 1
    (("n", 16, 2, 2, "h", "w"), (0, 1, 4, 2, 5, 3), True),  # pixel shuffle, dynamic=True: sizes read at run time
    (("n", "s", 4, "d"), (0, 2, 1, 3), False),             # a symbolic innermost axis counts as a long row
])
def test_transposes_ort_moves_element_by_element_run_as_kernels(dims, perm, kernel):
    ops, session = _one_transpose(dims, perm, ir.DataType.FLOAT)
    assert ("TransposeRows" in ops) == kernel
    if not kernel:
        return
    data = np.random.randn(*[d if isinstance(d, int) else 5 for d in dims]).astype(np.float32)
    np.testing.assert_array_equal(session.run(None, {"x": data})[0], data.transpose(perm))


@pytest.mark.parametrize("dims, perm, op", [
    ((8, 128, 4, 64), (0, 2, 1, 3), "MergeHeadsBf16"),     # attention's heads back into rows
    ((8, 4, 128, 64), (0, 1, 3, 2), "TransposeRowsBf16"),  # k transposed: ORT's bfloat16 Transpose is slow
    ((5, 7, 9, 64), (3, 0, 2, 1), "TransposeRowsBf16"),    # every axis moves
    ((8, 56, 56, 64), (0, 3, 1, 2), "Transpose"),          # NHWC to NCHW: ORT's is faster (transposes.py --bfloat16)
])
def test_a_bfloat16_transpose_runs_as_a_kernel_where_orts_is_slower(dims, perm, op):
    """ORT's bfloat16 Transpose copies rows slower than its float32 one (attention's heads under
    autocast): there, and where its float32 one is slow, the Transpose is a kernel."""
    from ort_dynamo.run import _wrap

    ops, session = _one_transpose(dims, perm, ir.DataType.BFLOAT16)
    assert ops == [op]
    data = torch.randn(*dims).bfloat16()
    (out,) = session.run_with_ort_values(["y"], {"x": ort.OrtValue(_wrap(data, data.data_ptr(), None))})
    assert torch.equal(torch.from_dlpack(out._ortvalue.to_dlpack()), data.permute(*perm))


@pytest.mark.parametrize("dims, op", [
    ((8, 4, 128, 64), "MergeHeads"),       # BERT's and Llama's attention output, and their q, k and v gradients
    ((2, 12, 7, 16), "MergeHeads"),        # rows of 16 floats: still whole rows
    ((2, 12, 7, 8), "Transpose"),          # rows of 8: ORT's
    (("batch", 4, "seq", 64), "MergeHeads"),  # dynamic batch and sequence length: read at run time
])
def test_attention_heads_move_back_into_rows_in_one_kernel(dims, op):
    """A Transpose [0, 2, 1, 3] of attention's [B, H, S, D] copies rows of D: ``MergeHeads``,
    faster than ORT's Transpose (benchmarks/transposes.py)."""
    ops, session = _one_transpose(dims, (0, 2, 1, 3), ir.DataType.FLOAT)
    assert ops == [op]
    for size in ((8, 4, 128, 64), (3, 4, 5, 64)) if isinstance(dims[0], str) else (dims,):
        data = np.random.randn(*size).astype(np.float32)
        np.testing.assert_array_equal(session.run(None, {"x": data})[0], data.transpose(0, 2, 1, 3))


def _heads_concat(parts: list[tuple[int, int]], also_read: bool = False, dtype=ir.DataType.FLOAT):
    """The model of GPT-2's q, k and v gradients side by side: ``Concat([Reshape(Transpose(x_i,
    [0, 2, 1, 3]), [B, S, H_i * D_i])], -1)`` for x_i [B, H_i, S, D_i] of ``parts``' (H_i, D_i),
    after the pointwise stage; ``also_read``: the first Reshape is also a graph output. Returns
    its op types and a session."""
    batch, seq = 2, 9
    xs = [ir.Value(name=f"x{i}", shape=ir.Shape([batch, h, seq, d]), type=ir.TensorType(dtype))
          for i, (h, d) in enumerate(parts)]
    nodes, rows = [], []
    for i, (x, (h, d)) in enumerate(zip(xs, parts)):
        shape = ir.Value(name=f"shape{i}", const_value=ir.tensor(np.array([batch, seq, h * d], dtype=np.int64)))
        moved = ir.node("Transpose", [x], attributes={"perm": [0, 2, 1, 3]})
        reshape = ir.node("Reshape", [moved.outputs[0], shape])
        for node, dims in ((moved, [batch, seq, h, d]), (reshape, [batch, seq, h * d])):
            node.outputs[0].shape, node.outputs[0].dtype = ir.Shape(dims), dtype
        nodes += [moved, reshape]
        rows.append(reshape.outputs[0])
    concat = ir.node("Concat", rows, attributes={"axis": -1})
    concat.outputs[0].name, concat.outputs[0].dtype = "y", dtype
    outputs = [concat.outputs[0]] + ([rows[0]] if also_read else [])
    initializers = [n.inputs[1] for n in nodes if n.op_type == "Reshape"]
    return _after_pointwise_stage(ir.Model(ir.Graph(xs, outputs, nodes=nodes + [concat], initializers=initializers,
                                                    opset_imports={"": 18}), ir_version=10))


@pytest.mark.parametrize("parts", [[(4, 64)] * 3, [(4, 64), (2, 32), (3, 16)]])
def test_heads_concatenated_for_one_projection_are_one_kernel(parts):
    """GPT-2's q, k and v gradients: three heads-to-rows moves and their Concat, which ORT runs
    as three Transposes and a Concat (two passes), are one ``ConcatHeads3`` (one pass); the
    parts may have their own heads and depths."""
    ops, session = _heads_concat(parts)
    assert ops == ["ConcatHeads3"], ops
    data = {f"x{i}": np.random.randn(2, h, 9, d).astype(np.float32) for i, (h, d) in enumerate(parts)}
    want = np.concatenate([x.transpose(0, 2, 1, 3).reshape(2, 9, -1) for x in data.values()], -1)
    np.testing.assert_array_equal(session.run(None, data)[0], want)


def test_bfloat16_heads_concatenate_in_one_kernel():
    """Under CPU autocast the q, k and v gradients are bfloat16: ``ConcatHeads3Bf16``, the same
    row copies of 2-byte elements."""
    from ort_dynamo.run import _wrap

    ops, session = _heads_concat([(4, 64)] * 3, dtype=ir.DataType.BFLOAT16)
    assert ops == ["ConcatHeads3Bf16"], ops
    data = [torch.randn(2, 4, 9, 64).bfloat16() for _ in range(3)]
    feeds = {f"x{i}": ort.OrtValue(_wrap(x, x.data_ptr(), None)) for i, x in enumerate(data)}
    (out,) = session.run_with_ort_values(["y"], feeds)
    want = torch.cat([x.permute(0, 2, 1, 3).reshape(2, 9, -1) for x in data], -1)
    assert torch.equal(torch.from_dlpack(out._ortvalue.to_dlpack()), want)


def test_heads_read_elsewhere_are_not_concatenated_in_a_kernel():
    """A part the graph also returns must exist on its own: the Concat stays ORT's (its moves
    are ``MergeHeads``), with the same values."""
    ops, session = _heads_concat([(4, 64)] * 3, also_read=True)
    assert "Concat" in ops and not any(op.startswith("ConcatHeads") for op in ops), ops
    data = {f"x{i}": np.random.randn(2, 4, 9, 64).astype(np.float32) for i in range(3)}
    y, first = session.run(None, data)
    np.testing.assert_array_equal(first, data["x0"].transpose(0, 2, 1, 3).reshape(2, 9, -1))
    np.testing.assert_array_equal(y, np.concatenate([x.transpose(0, 2, 1, 3).reshape(2, 9, -1)
                                                     for x in data.values()], -1))


def _heads_split(parts: list[tuple[int, int]], bias: str, also_read: bool = False):
    """The model of GPT-2's q, k and v from its one projection: ``Transpose(Reshape(part_i, [B, S,
    H_i, D_i]) + bias_i, [0, 2, 1, 3])`` for the parts of a Split of x [B, S, sum H_i * D_i], after
    the pointwise stage. ``bias``: "none"; "one", a bias b [W] split and viewed as [H_i, D_i] (as
    ``bias_after_reshape`` leaves GPT-2's); "parts", inputs b0, b1, ... of [H_i, D_i].
    ``also_read``: the first part's view is also a graph output. Returns its op types and a
    session."""
    batch, seq, width = 2, 9, sum(h * d for h, d in parts)
    x = ir.Value(name="x", shape=ir.Shape([batch, seq, width]), type=ir.TensorType(ir.DataType.FLOAT))
    split = ir.node("Split", [x], attributes={"axis": -1, "num_outputs": len(parts)}, num_outputs=len(parts))
    nodes, inputs, initializers, outputs = [split], [x], [], []
    if bias == "one":
        whole = ir.Value(name="b", shape=ir.Shape([width]), type=ir.TensorType(ir.DataType.FLOAT))
        sizes = ir.Value(name="sizes", const_value=ir.tensor(np.array([h * d for h, d in parts], dtype=np.int64)))
        pieces = ir.node("Split", [whole, sizes], attributes={"axis": 0}, num_outputs=len(parts))
        inputs, initializers, nodes = [x, whole], [sizes], [split, pieces]
    for i, (part, (h, d)) in enumerate(zip(split.outputs, parts)):
        part.shape, part.dtype = ir.Shape([batch, seq, h * d]), ir.DataType.FLOAT
        shape = ir.Value(name=f"shape{i}", const_value=ir.tensor(np.array([batch, seq, h, d], dtype=np.int64)))
        initializers.append(shape)
        view = ir.node("Reshape", [part, shape])
        view.outputs[0].shape, view.outputs[0].dtype = ir.Shape([batch, seq, h, d]), ir.DataType.FLOAT
        nodes.append(view)
        heads = view.outputs[0]
        if bias != "none":
            if bias == "parts":
                b = ir.Value(name=f"b{i}", shape=ir.Shape([h, d]), type=ir.TensorType(ir.DataType.FLOAT))
                inputs.append(b)
            else:
                bias_shape = ir.Value(name=f"bias_shape{i}", const_value=ir.tensor(np.array([h, d], dtype=np.int64)))
                initializers.append(bias_shape)
                bias_view = ir.node("Reshape", [pieces.outputs[i], bias_shape])
                b = bias_view.outputs[0]
                b.shape, b.dtype = ir.Shape([h, d]), ir.DataType.FLOAT
                nodes.append(bias_view)
            add = ir.node("Add", [heads, b])
            add.outputs[0].shape, add.outputs[0].dtype = ir.Shape([batch, seq, h, d]), ir.DataType.FLOAT
            nodes.append(add)
            heads = add.outputs[0]
        moved = ir.node("Transpose", [heads], attributes={"perm": [0, 2, 1, 3]})
        moved.outputs[0].name, moved.outputs[0].dtype = f"y{i}", ir.DataType.FLOAT
        moved.outputs[0].shape = ir.Shape([batch, h, seq, d])
        nodes.append(moved)
        outputs.append(moved.outputs[0])
    if also_read:
        outputs.append(next(n for n in nodes if n.op_type == "Reshape").outputs[0])
    return _after_pointwise_stage(ir.Model(ir.Graph(inputs, outputs, nodes=nodes, initializers=initializers,
                                                    opset_imports={"": 18}), ir_version=10))


@pytest.mark.parametrize("parts, bias, ops", [
    ([(4, 64)] * 3, "one", ["SplitHeads3Bias"]),                  # GPT-2's c_attn: its bias whole
    ([(4, 64)] * 3, "none", ["SplitHeads3"]),                     # a projection without a bias
    ([(4, 64), (2, 32), (3, 16)], "one", ["SplitHeads3Bias"]),    # parts of their own sizes
    ([(4, 64)] * 3, "parts", ["Reshape"] * 3 + ["Concat", "SplitHeads3Bias"]),  # biases of their own: joined
])
def test_one_projection_splits_into_heads_in_one_kernel(parts, bias, ops):
    """GPT-2's q, k and v: a Split of the projection, each part viewed as heads, its bias added
    and moved into [B, H, S, D], which ORT ran as a Split and a kernel per part, is one
    ``SplitHeads`` pass with the same values."""
    got_ops, session = _heads_split(parts, bias)
    assert got_ops == ops
    rng = np.random.default_rng(0)
    width = sum(h * d for h, d in parts)
    feeds = {"x": rng.standard_normal((2, 9, width), dtype=np.float32)}
    biases = [rng.standard_normal((h, d), dtype=np.float32) for h, d in parts]
    if bias == "one":
        feeds["b"] = np.concatenate([b.reshape(-1) for b in biases])
    elif bias == "parts":
        feeds.update({f"b{i}": b for i, b in enumerate(biases)})
    offsets = np.cumsum([0] + [h * d for h, d in parts])
    for i, ((h, d), got) in enumerate(zip(parts, session.run(None, feeds))):
        want = feeds["x"][..., offsets[i]:offsets[i + 1]].reshape(2, 9, h, d) + (biases[i] if bias != "none" else 0)
        np.testing.assert_array_equal(got, want.transpose(0, 2, 1, 3))


def test_a_split_part_read_elsewhere_is_not_split_in_a_kernel():
    """A part's view the graph also returns must exist: the Split stays ORT's."""
    ops, _ = _heads_split([(4, 64)] * 3, "one", also_read=True)
    assert "Split" in ops and not any(op.startswith("SplitHeads") for op in ops), ops


def test_attentions_softmax_backward_viewed_with_other_leading_axes_is_two_kernels():
    """Attention's softmax backward with the probabilities recomputed, as the exporter writes
    it: the scores come from a batched product [B * H, S, S] and are viewed as [B, H, S, S] to
    subtract the saved log-sum-exp; the probabilities go back to [B * H, S, S], where the
    gradient's row sum and the rest are computed. The views split the rest into a kernel and two
    ORT Muls (three kernels in BERT's step); with the chains between them computed in the
    products' shape it is two kernels (the probabilities, which a product reads too, then the
    rest), with the same values."""
    f32 = ir.TensorType(ir.DataType.FLOAT)
    scores = ir.Value(name="scores", shape=ir.Shape([6, 64, 64]), type=f32)
    lse = ir.Value(name="lse", shape=ir.Shape([2, 3, 64, 1]), type=f32)
    grad = ir.Value(name="grad", shape=ir.Shape([6, 64, 64]), type=f32)
    consts = [ir.Value(name=n, const_value=ir.tensor(np.array(d, dtype=np.int64)))
              for n, d in (("heads", [2, 3, 64, 64]), ("batched", [6, 64, 64]), ("last", [-1]))]
    view = ir.node("Reshape", [scores, consts[0]])
    shifted = ir.node("Sub", [view.outputs[0], lse])
    probs = ir.node("Exp", [shifted.outputs[0]])
    back = ir.node("Reshape", [probs.outputs[0], consts[1]])
    weighted = ir.node("Mul", [grad, back.outputs[0]])
    total = ir.node("ReduceSum", [weighted.outputs[0], consts[2]], attributes={"keepdims": 1})
    centred = ir.node("Sub", [grad, total.outputs[0]])
    product = ir.node("Mul", [back.outputs[0], centred.outputs[0]])
    scale = ir.node("Constant", [], attributes={"value": ir.tensor(np.array(0.125, dtype=np.float32))})
    scaled = ir.node("Mul", [product.outputs[0], scale.outputs[0]])
    nodes = [view, shifted, probs, back, weighted, total, centred, product, scale, scaled]
    for node in nodes:
        node.outputs[0].dtype = ir.DataType.FLOAT
        node.outputs[0].shape = ir.Shape([6, 64, 1] if node is total else
                                         [2, 3, 64, 64] if node in (view, shifted, probs) else [6, 64, 64])
    scale.outputs[0].shape = ir.Shape([])
    scaled.outputs[0].name, back.outputs[0].name = "y", "probs"
    model = ir.Model(ir.Graph([scores, lse, grad], [scaled.outputs[0], back.outputs[0]], nodes=nodes,
                              initializers=consts, opset_imports={"": 18}), ir_version=10)
    ops, session = _after_pointwise_stage(model)
    assert [op[:3] for op in ops if op not in ("Reshape", "Constant")] == ["pw_"] * 2, ops
    rng = np.random.default_rng(0)
    feeds = {"scores": rng.standard_normal((6, 64, 64), dtype=np.float32),
             "lse": rng.standard_normal((2, 3, 64, 1), dtype=np.float32) + 3,
             "grad": rng.standard_normal((6, 64, 64), dtype=np.float32)}
    p = np.exp(feeds["scores"].reshape(2, 3, 64, 64) - feeds["lse"]).reshape(6, 64, 64)
    want = p * (feeds["grad"] - (feeds["grad"] * p).sum(-1, keepdims=True)) * 0.125
    got, got_probs = session.run(None, feeds)
    np.testing.assert_allclose(got_probs, p, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_swiglus_product_stays_in_the_kernel_of_its_silu():
    """Llama's MLP as the exporter writes it: the gate and up products [T, F] viewed as [B, S, F],
    silu(gate) * up, and the product viewed back as [T, F] for the down projection. Computing the
    product in the products' own shape would leave silu alone in its kernel, written out for a
    second pass (a kernel and an ORT Mul before); in silu's shape it is one kernel."""
    f32 = ir.TensorType(ir.DataType.FLOAT)
    gate, up = (ir.Value(name=n, shape=ir.Shape([512, 96]), type=f32) for n in ("gate", "up"))
    consts = [ir.Value(name=n, const_value=ir.tensor(np.array(d, dtype=np.int64)))
              for n, d in (("rows", [4, 128, 96]), ("tokens", [512, 96]))]
    gate_rows, up_rows = ir.node("Reshape", [gate, consts[0]]), ir.node("Reshape", [up, consts[0]])
    sigmoid = ir.node("Sigmoid", [gate_rows.outputs[0]])
    silu = ir.node("Mul", [gate_rows.outputs[0], sigmoid.outputs[0]])
    product = ir.node("Mul", [silu.outputs[0], up_rows.outputs[0]])
    back = ir.node("Reshape", [product.outputs[0], consts[1]])
    nodes = [gate_rows, up_rows, sigmoid, silu, product, back]
    for node in nodes:
        node.outputs[0].dtype = ir.DataType.FLOAT
        node.outputs[0].shape = ir.Shape([512, 96] if node is back else [4, 128, 96])
    back.outputs[0].name = "y"
    model = ir.Model(ir.Graph([gate, up], [back.outputs[0]], nodes=nodes, initializers=consts,
                              opset_imports={"": 18}), ir_version=10)
    ops, session = _after_pointwise_stage(model)
    assert [op[:3] for op in ops if op not in ("Reshape", "Constant")] == ["pw_"], ops
    rng = np.random.default_rng(0)
    feeds = {name: rng.standard_normal((512, 96), dtype=np.float32) for name in ("gate", "up")}
    want = feeds["gate"] / (1 + np.exp(-feeds["gate"])) * feeds["up"]
    np.testing.assert_allclose(session.run(None, feeds)[0], want, rtol=1e-5, atol=1e-6)


class _FusedProjectionAttention(nn.Module):
    """nanoGPT's attention: one q/k/v projection split into heads, causal softmax, heads merged."""

    def __init__(self, width: int = 128, heads: int = 4):
        super().__init__()
        self.heads, self.qkv, self.out = heads, nn.Linear(width, 3 * width), nn.Linear(width, width)

    def forward(self, x):
        b, s, c = x.shape
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in self.qkv(x).split(c, -1))
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(c // self.heads)
        mask = torch.ones(s, s, dtype=torch.bool).tril()
        attention = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v
        return self.out(attention.transpose(1, 2).reshape(b, s, c))


def test_a_fused_projections_attention_trains_with_its_heads_moved_by_kernels(tmp_path):
    """Training through one q/k/v projection: the projection's split into heads is one
    ``SplitHeads3Bias``; its gradient's three heads-to-rows moves and their Concat are one
    ``ConcatHeads3``, the attention output's move a ``MergeHeads``; values and gradients are
    eager's."""
    torch.manual_seed(0)
    model, x = _FusedProjectionAttention(), torch.randn(4, 64, 128)
    got = _step(model, x, {}, tmp_path)
    model.zero_grad()
    out = model(x)
    out.square().sum().backward()
    want = [out.detach()] + [p.grad.clone() for p in model.parameters()]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    ops = _ops(glob.glob(str(tmp_path / "*.onnx")))
    assert "ConcatHeads3" in ops and "MergeHeads" in ops and "Concat" not in ops, ops
    assert "SplitHeads3Bias" in ops and "Split" not in ops, ops


def test_transpose_kernel_rejects_a_perm_that_is_no_permutation():
    x = ir.Value(name="x", shape=ir.Shape([4, 5, 6]), type=ir.TensorType(ir.DataType.FLOAT))
    perm = ir.Value(name="perm", const_value=ir.tensor(np.array([2, 0, 2], dtype=np.int64)))
    node = ir.node("TransposeRows", [x, perm], domain=_pointwise.DOMAIN)
    node.outputs[0].name, node.outputs[0].dtype = "y", ir.DataType.FLOAT
    graph = ir.Graph([x], node.outputs, nodes=[node], initializers=[perm],
                     opset_imports={"": 18, _pointwise.DOMAIN: 1})
    from ort_dynamo import _op_kernels

    so = ort.SessionOptions()
    so.register_custom_ops_library(_kernels.library([_op_kernels.TRANSPOSE_ROWS]))
    session = ort.InferenceSession(ir.serde.serialize_model(ir.Model(graph, ir_version=10)).SerializeToString(), so,
                                   providers=["CPUExecutionProvider"])
    with pytest.raises(Exception, match="TransposeRows: perm is not a permutation"):
        session.run(None, {"x": np.zeros((4, 5, 6), np.float32)})


def test_a_transpose_a_matmul_reads_is_left_to_ort():
    """ORT folds a Transpose into the MatMul that reads it (FusedMatMul): no kernel there."""
    x = ir.Value(name="x", shape=ir.Shape([16, 64, 48]), type=ir.TensorType(ir.DataType.FLOAT))
    w = ir.Value(name="w", shape=ir.Shape([64, 32]), type=ir.TensorType(ir.DataType.FLOAT))
    transpose = ir.node("Transpose", [x], attributes={"perm": [0, 2, 1]})
    transpose.outputs[0].shape, transpose.outputs[0].dtype = ir.Shape([16, 48, 64]), ir.DataType.FLOAT
    product = ir.node("MatMul", [transpose.outputs[0], w])
    product.outputs[0].name = "y"
    model = ir.Model(ir.Graph([x, w], product.outputs, nodes=[transpose, product], opset_imports={"": 18}),
                     ir_version=10)
    _pointwise.fuse_pointwise(model)
    assert [n.op_type for n in model.graph] == ["Transpose", "MatMul"]


class _AutocastBlock(nn.Module):
    """A transformer MLP block as CPU autocast runs it: bfloat16 products, a tanh GELU between
    them, the residual and the norm in float32."""

    def __init__(self):
        super().__init__()
        self.up, self.down, self.norm = nn.Linear(64, 256), nn.Linear(256, 64), nn.LayerNorm(64)

    def forward(self, x):
        return self.norm(x + self.down(F.gelu(self.up(x), approximate="tanh")))


def _onnx_casts_to_bfloat16(path):
    """The element count of each ONNX Cast to bfloat16 left in a saved model (static shapes)."""
    model = onnx.shape_inference.infer_shapes(onnx.load(path))
    shapes = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim]
              for v in [*model.graph.value_info, *model.graph.input, *model.graph.output]}
    return [int(np.prod(shapes.get(n.input[0], [0]))) for n in model.graph.node
            if n.op_type == "Cast" and any(a.name == "to" and a.i == onnx.TensorProto.BFLOAT16 for a in n.attribute)]


def test_cpu_autocasts_bfloat16_casts_round_inside_kernels_with_eagers_results(tmp_path):
    """Under CPU autocast every op computes in float32 between Casts to and from bfloat16
    (ORT's CPU provider has no bfloat16 GEMM). A kernel holds bfloat16 values as the float32
    they are: a GELU's chain rounds its result itself, and a GEMM's result is rounded, its
    bias added, by a kernel, not by ORT's element-by-element Cast."""
    torch.manual_seed(0)
    model, x = _AutocastBlock(), torch.randn(8, 128, 64)
    results = {}
    for name, options in (("kernels", {"save_onnx": True, "save_path": str(tmp_path)}),
                          ("no kernels", {"pointwise_kernels": False})):
        ort_dynamo.reset()
        # ort_dynamo's own products (torch's BLAS takes them where cpu_matmul picks it: test_torch_blas.py)
        compiled = torch.compile(model, backend="ort", options={**options, "cpu_matmul": "ort"})
        for step in range(2):
            model.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = compiled(x)
            out.square().sum().backward()
            ort_dynamo.wait_for_kernels()
        results[name] = [out.detach()] + [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    out.square().sum().backward()
    eager = [out.detach()] + [p.grad.clone() for p in model.parameters()]
    for got, unfused, want in zip(results["kernels"], results["no kernels"], eager):
        scale = want.abs().max().item()
        torch.testing.assert_close(got, unfused, rtol=0, atol=1e-2 * scale)
        torch.testing.assert_close(got, want, rtol=0, atol=3e-2 * scale)
    models = glob.glob(str(tmp_path / "*.onnx"))
    chains = [n.doc_string for p in models for n in _pointwise_nodes(p)]
    # The GELU's result rounded, then widened for the next GEMM; a GEMM's result rounded.
    assert any(c.endswith("|Cast|Cast") and "Tanh" in c for c in chains), chains
    assert {"Cast", "Cast|Cast"} & set(chains), chains
    code = "".join(open(p).read() for p in glob.glob(str(tmp_path / "*.pointwise.c")))
    assert "PW_BF16" in code and "pw_round_bf16" in code
    # What stays an ORT Cast to bfloat16 is below the kernels' size.
    assert all(elements < _pointwise.MIN_ELEMENTS for p in models for elements in _onnx_casts_to_bfloat16(p))
    # A Linear's bias is added in the kernel that rounds its product, not by ORT's Gemm; the
    # products are bfloat16 ones where the compiler targets AVX512-BF16 (test_bf16_products.py).
    product = "Bf16MatMulNT" if _kernels.bfloat16_products() else "MatMul"
    assert "Gemm" not in _ops(models) and product in [op.split("_")[0] for op in _ops(models)]
    # A GEMM's operand is widened before the view that shapes it, in the kernel that rounds it.
    for path in models:
        graph = onnx.load(path).graph
        producers = {out: n.op_type for n in graph.node for out in n.output}
        assert not [n.name for n in graph.node if n.op_type == "Cast" and producers.get(n.input[0]) in ("Reshape", "Transpose")]


def test_a_cube_in_a_kernel_is_multiplied_out_as_torch_and_ort_do():
    """x ** 3 is x * x * x in torch and ORT; powf rounds differently, and libmvec's SIMD powf
    takes a slow path for negative bases."""
    def fn(x, y):
        return x.pow(3) * y + y,

    ort_dynamo.reset()
    compiled = torch.compile(fn, backend="ort")
    x, y = torch.randn(64, 512) * 3, torch.randn(64, 512)
    compiled(x, y)
    ort_dynamo.wait_for_kernels()
    assert ort_dynamo.report().kernels >= 1
    assert torch.equal(compiled(x, y)[0], fn(x, y)[0])


def test_a_kernels_bfloat16_rounding_is_torchs_bit_for_bit():
    """Ties to even, overflow to infinity, subnormals, infinities and NaN: a kernel's rounding
    of float32 to bfloat16 gives torch's bits."""
    def fn(x):
        return x.to(torch.bfloat16), (x * 2).to(torch.bfloat16).float() + 1

    torch.manual_seed(0)
    specials = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), 3.3961e38, 3.3962e38, -3.4e38, 1e-40,
                             -1e-40, 2 ** -133, 0.0, -0.0, float("inf"), float("-inf"), float("nan")])
    x = torch.cat([specials, torch.randn(32768) * torch.exp2(torch.randint(-60, 60, (32768,)).float())])
    ort_dynamo.reset()
    compiled = torch.compile(fn, backend="ort")
    compiled(x)
    ort_dynamo.wait_for_kernels()
    assert ort_dynamo.report().kernels == 1  # both roundings
    numbers = ~x.isnan()
    for got, want in zip(compiled(x), fn(x)):
        assert got.dtype == want.dtype
        bits = torch.int16 if got.dtype == torch.bfloat16 else torch.int32
        assert torch.equal(got.view(bits)[numbers], want.view(bits)[numbers])
        assert got[~numbers].isnan().all()


@pytest.mark.parametrize("steps", [4, 12])
def test_a_small_chain_is_a_kernel_only_when_it_repeats_often_enough(tmp_path, steps):
    """Chains over fewer than MIN_ELEMENTS elements stay ORT ops (a compile for a few
    microseconds), unless the same chain repeats MIN_REPEATS times or more, as an unrolled
    recurrence's cell does once per step: one kernel then serves every step."""
    def recurrence(x, h, w):
        for t in range(x.shape[1]):
            h = torch.tanh(x[:, t] * 0.5 + h @ w) * 1.5  # the product ends each step's chain
        return h

    x, h, w = torch.randn(4, steps, 32), torch.randn(4, 32), torch.randn(32, 32) / 8  # 128 elements a step
    assert 4 * 32 < _pointwise.MIN_ELEMENTS and 4 < _pointwise.MIN_REPEATS <= 12
    compiled = torch.compile(recurrence, backend="ort", options={"save_onnx": True, "save_path": str(tmp_path)})
    compiled(x, h, w)
    ort_dynamo.wait_for_kernels()
    torch.testing.assert_close(compiled(x, h, w), recurrence(x, h, w))
    fused = [n for p in glob.glob(str(tmp_path / "*.onnx")) for n in _pointwise_nodes(p)]
    assert len(fused) == (steps if steps >= _pointwise.MIN_REPEATS else 0), [n.doc_string for n in fused]


# -- the GPU's kernels, as far as a machine without one can check them (tests/test_cuda.py runs them) --

def _bfloat16_gelu_like_chain(half=ir.DataType.BFLOAT16):
    """x (bfloat16) -> float32 -> + bias -> tanh -> bfloat16, then * g - g in bfloat16 (or
    ``half``, float16: CUDA autocast's default)."""
    bf16, f32 = half, ir.DataType.FLOAT
    x = ir.Value(name="x", shape=ir.Shape([8, 64, 384]), type=ir.TensorType(bf16))
    g = ir.Value(name="g", shape=ir.Shape([8, 64, 384]), type=ir.TensorType(bf16))
    bias = ir.Value(name="bias", shape=ir.Shape([384]), type=ir.TensorType(f32))
    up = ir.node("Cast", [x], attributes={"to": f32})
    add = ir.node("Add", [up.outputs[0], bias])
    tanh = ir.node("Tanh", [add.outputs[0]])
    down = ir.node("Cast", [tanh.outputs[0]], attributes={"to": bf16})
    mul = ir.node("Mul", [down.outputs[0], g])
    sub = ir.node("Sub", [mul.outputs[0], g])
    sub.outputs[0].name = "out"
    graph = ir.Graph([x, g, bias], [sub.outputs[0]], nodes=[up, add, tanh, down, mul, sub], opset_imports={"": 18})
    return ir.Model(graph, ir_version=10)


def test_on_the_gpu_a_bfloat16_chain_becomes_one_cuda_kernel_that_rounds_each_op_as_torch_does():
    model = _bfloat16_gelu_like_chain()
    kernels = _pointwise.fuse_pointwise(model, device="cuda")
    assert len(kernels) == 1 and _pointwise.is_cuda(kernels[0])
    [node] = list(model.graph)
    assert node.domain == _pointwise.DOMAIN and node.op_type in kernels[0]
    assert model.graph.outputs[0].dtype == ir.DataType.BFLOAT16
    source = kernels[0]
    # Rounded where a bfloat16 value is made: the Cast, the Mul and the Sub; the float32 Add not.
    assert source.count("pw_round_bf16(") == 3 and "pw_bf16_bits(t5)" in source
    # Its inputs in the order the kernel reads them: x and g bfloat16 (16), the bias float32 (1).
    assert "_in[] = {16, 1, 16};" in _pointwise.cuda_table_source(kernels)


def test_the_cuda_kernels_host_library_builds_without_a_gpu_and_declares_its_ops_for_the_cuda_provider(
        tmp_path, monkeypatch):
    from ort_dynamo import _nvrtc

    model = _bfloat16_gelu_like_chain()
    kernels = _pointwise.fuse_pointwise(model, device="cuda")
    monkeypatch.setattr(_nvrtc, "compile_cuda", lambda *args, **kwargs: b"\0")  # the binary is not run here
    path = _kernels._cuda_library(kernels, str(tmp_path), "sm_90")
    assert path.startswith(str(tmp_path)) and _kernels._cuda_library(kernels, str(tmp_path), "sm_90") == path
    so = ort.SessionOptions()
    so.register_custom_ops_library(path)  # RegisterCustomOps ran: the ABI and the table agree
    with pytest.raises(Exception, match="Could not find an implementation for pw_"):  # CUDA's only
        ort.InferenceSession(ir.serde.serialize_model(model).SerializeToString(), so,
                             providers=["CPUExecutionProvider"])


def test_on_the_gpu_a_float16_chain_is_one_kernel_too_rounding_to_float16():
    model = _bfloat16_gelu_like_chain(ir.DataType.FLOAT16)
    [source] = _pointwise.fuse_pointwise(model, device="cuda")
    assert len(list(model.graph)) == 1 and model.graph.outputs[0].dtype == ir.DataType.FLOAT16
    assert source.count("pw_round_f16(") == 3 and "pw_bf16" not in source and "pw_f16_bits(t5)" in source
    assert "_in[] = {10, 1, 10};" in _pointwise.cuda_table_source([source])
    # On the CPU no float16 op is a kernel op: rewrite leaves them to ORT.
    cpu = _bfloat16_gelu_like_chain(ir.DataType.FLOAT16)
    assert all("f16" not in k for k in _pointwise.fuse_pointwise(cpu))


@pytest.mark.parametrize("half", [ir.DataType.BFLOAT16, ir.DataType.FLOAT16])
def test_nvrtc_compiles_the_generated_cuda_kernels_and_names_what_it_refuses(half):
    from ort_dynamo import _nvrtc

    if not _nvrtc.available():
        pytest.skip("no NVRTC here (the nvidia-cuda-nvrtc wheel that CUDA builds of torch install)")
    kernels = _pointwise.fuse_pointwise(_bfloat16_gelu_like_chain(half), device="cuda")
    with open(os.path.join(os.path.dirname(_pointwise.__file__), "csrc", "pointwise_cuda.h")) as fh:
        headers = {"pointwise_cuda.h": fh.read()}
    cubin = _nvrtc.compile_cuda('#include "pointwise_cuda.h"\n' + kernels[0], "sm_90", headers)
    assert cubin[:4] == b"\x7fELF"
    with pytest.raises(_nvrtc.NvrtcError, match="undefined"):
        _nvrtc.compile_cuda("__global__ void k() { nonsense(); }", "sm_90", {})


def test_a_cuda_kernel_build_that_nvrtc_refuses_is_a_kernel_build_error_the_partition_survives(tmp_path, monkeypatch):
    from ort_dynamo import _nvrtc

    kernels = _pointwise.fuse_pointwise(_bfloat16_gelu_like_chain(), device="cuda")

    def refuse(*args, **kwargs):
        raise _nvrtc.NvrtcError("NVRTC 12.0 refused the kernels for sm_120: invalid value for --gpu-architecture")

    monkeypatch.setattr(_nvrtc, "compile_cuda", refuse)
    # run.py catches this one error: the partition then runs without its kernels, and warns.
    with pytest.raises(_kernels.KernelBuildError, match="sm_120"):
        _kernels._cuda_library(kernels, str(tmp_path), "sm_120")


# -- the CUDA kernels' code, run on the CPU (tests/csrc/cuda_on_cpu.h): what they compute --------

class _PwCudaArgs(ctypes.Structure):
    """csrc/pointwise_cuda.h's PwCudaArgs, field for field."""
    _fields_ = [("numel", ctypes.c_int64), ("rank", ctypes.c_int64), ("dims", ctypes.c_int64 * 8),
                ("in_numel", ctypes.c_int64 * 32), ("strides", (ctypes.c_int64 * 8) * 32),
                ("inputs", ctypes.c_void_p * 32), ("outputs", ctypes.c_void_p * 32), ("mode", ctypes.c_int32 * 32)]


@functools.lru_cache(None)
def _cxx20():
    """A C++ compiler that has C++20's <barrier> (the emulation's __syncthreads), or None."""
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        return None
    probe = subprocess.run([compiler, "-std=c++20", "-fsyntax-only", "-x", "c++", "-"], input="#include <barrier>\n",
                           capture_output=True, text=True)
    return compiler if probe.returncode == 0 else None


def _cuda_kernels_on_cpu(kernels, folder):
    """The generated CUDA C of ``kernels`` built for this CPU: a ctypes library with
    ``prepare`` (the host library's broadcasting, csrc/pointwise_cuda.h) and ``run_<name>``."""
    compiler = _cxx20()
    if compiler is None:
        pytest.skip("no C++20 compiler (with <barrier>) to build the CUDA kernels for the CPU with")
    names = [json.loads(k.splitlines()[0].split("kernel ", 1)[1])["name"] for k in kernels]
    source = "\n".join(['#include "cuda_on_cpu.h"', *kernels,
                        'extern "C" int prepare(PwCudaArgs* a, int n, const int64_t (*shapes)[PW_MAX_RANK], '
                        "const size_t* ranks) { return pw_cuda_prepare(a, n, shapes, ranks); }",
                        *[f'extern "C" void run_{n}(const PwCudaArgs* a, unsigned grid, unsigned block) '
                          f'{{ pw_launch<{n}>(a, grid, block); }}' for n in names]])
    src, lib = os.path.join(folder, "kernels.cpp"), os.path.join(folder, "kernels.so")
    with open(src, "w") as fh:
        fh.write(source)
    csrc = os.path.join(os.path.dirname(_pointwise.__file__), "csrc")
    subprocess.run([compiler, "-std=c++20", "-O1", "-fPIC", "-shared", "-pthread", "-w", "-I", csrc, "-I",
                    os.path.join(os.path.dirname(__file__), "csrc"), src, "-o", lib], check=True)
    return ctypes.CDLL(lib), names


def _run_cuda_kernel_on_cpu(library, name, inputs, out_dtypes, grid=1, block=1, out_kinds=None):
    """What the host library and the kernel do for one launch with these torch tensors, on
    ``grid`` blocks of ``block`` threads: the outputs (one per dtype; a row sum's last axis 1)."""
    args = _PwCudaArgs()
    shapes = ((ctypes.c_int64 * 8) * 32)()
    ranks = (ctypes.c_size_t * 32)(*[t.dim() for t in inputs])
    for i, t in enumerate(inputs):
        shapes[i][:t.dim()] = list(t.shape)
        args.inputs[i] = t.data_ptr()
    if library.prepare(ctypes.byref(args), len(inputs), shapes, ranks):
        raise ValueError("the inputs' shapes do not broadcast")
    dims = list(args.dims[:args.rank])
    outs = []
    for j, dtype in enumerate([out_dtypes] if isinstance(out_dtypes, torch.dtype) else out_dtypes):
        outs.append(torch.empty(dims[:-1] + [1] if out_kinds and out_kinds[j] == 1 else dims, dtype=dtype))
        args.outputs[j] = outs[-1].data_ptr()
    getattr(library, f"run_{name}")(ctypes.byref(args), grid, block)
    return outs[0] if isinstance(out_dtypes, torch.dtype) else outs


def _tanh_chain(half):
    """tanh(x * y + x) - y, op by op in ``half`` (or float32)."""
    x = ir.Value(name="x", shape=ir.Shape([4, 96, 130]), type=ir.TensorType(half))
    y = ir.Value(name="y", shape=ir.Shape([4, 96, 130]), type=ir.TensorType(half))
    mul = ir.node("Mul", [x, y])
    add = ir.node("Add", [mul.outputs[0], x])
    tanh = ir.node("Tanh", [add.outputs[0]])
    sub = ir.node("Sub", [tanh.outputs[0], y])
    return ir.Model(ir.Graph([x, y], sub.outputs, nodes=[mul, add, tanh, sub], opset_imports={"": 18}), ir_version=10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_cuda_kernels_code_broadcasts_and_rounds_as_torch_computes_op_by_op(tmp_path, dtype):
    """The CUDA C of tanh(x * y + x) - y, and the host library's choice of how each input is
    read, built for this CPU: every read pattern (full, a bias's suffix, a row statistic's
    column, a scalar, a general broadcast, the smaller input first), each 16-bit op rounded as
    torch rounds it. (tests/test_cuda.py runs the same on a GPU.)"""
    half = {torch.float32: ir.DataType.FLOAT, torch.bfloat16: ir.DataType.BFLOAT16,
            torch.float16: ir.DataType.FLOAT16}[dtype]
    kernels = _pointwise.fuse_pointwise(_tanh_chain(half), device="cuda")
    library, [name] = _cuda_kernels_on_cpu(kernels, str(tmp_path))
    assert ctypes.sizeof(_PwCudaArgs) == 3024
    torch.manual_seed(0)
    x = torch.randn(4, 96, 130).to(dtype)
    tolerance = {torch.bfloat16: dict(rtol=8e-3, atol=1e-5), torch.float16: dict(rtol=1e-3, atol=1e-5)}.get(
        dtype, dict(rtol=1e-6, atol=1e-6))
    for y_shape in [(4, 96, 130), (130,), (4, 96, 1), (1,), (4, 1, 130), (96, 1)]:
        y = torch.randn(y_shape).to(dtype)
        torch.testing.assert_close(_run_cuda_kernel_on_cpu(library, name, [x, y], dtype, grid=3, block=4),
                                   torch.tanh(x * y + x) - y, **tolerance, msg=lambda m: f"y of shape {y_shape}: {m}")
    small = torch.randn(130).to(dtype)
    torch.testing.assert_close(_run_cuda_kernel_on_cpu(library, name, [small, x], dtype),
                               torch.tanh(small * x + small) - x, **tolerance)
    with pytest.raises(ValueError, match="do not broadcast"):
        _run_cuda_kernel_on_cpu(library, name, [torch.ones(2, 3).to(dtype), torch.ones(4, 3).to(dtype)], dtype)


@pytest.mark.parametrize("half", [ir.DataType.BFLOAT16, ir.DataType.FLOAT16])
def test_a_cuda_kernels_casts_round_once_where_the_graph_rounds(tmp_path, half):
    """The GELU-like chain: x (16-bit) -> float32 + bias -> tanh -> 16-bit -> * g - g. The
    float32 part is not rounded; the Cast and each 16-bit op are."""
    kernels = _pointwise.fuse_pointwise(_bfloat16_gelu_like_chain(half), device="cuda")
    library, [name] = _cuda_kernels_on_cpu(kernels, str(tmp_path))
    dtype = torch.bfloat16 if half == ir.DataType.BFLOAT16 else torch.float16
    torch.manual_seed(0)
    x, g, bias = torch.randn(8, 64, 384).to(dtype), torch.randn(8, 64, 384).to(dtype), torch.randn(384)
    want = torch.tanh(x.float() + bias).to(dtype) * g - g
    got = _run_cuda_kernel_on_cpu(library, name, [x, bias, g], dtype)  # the kernel's input order
    torch.testing.assert_close(got, want, rtol=8e-3 if dtype == torch.bfloat16 else 1e-3, atol=1e-5)


def test_a_broken_nvrtc_turns_cuda_kernels_off_once_with_one_warning(monkeypatch, caplog):
    from ort_dynamo import _nvrtc

    def refuse(*args, **kwargs):
        raise _nvrtc.NvrtcError("NVRTC 12.0 refused the kernels for sm_120: invalid value for --gpu-architecture")

    monkeypatch.setattr(_nvrtc, "available", lambda: True)
    monkeypatch.setattr(_nvrtc, "compile_cuda", refuse)
    monkeypatch.setattr(_kernels, "_cuda_arch", lambda index: "sm_120")
    monkeypatch.setattr("torch.cuda.current_device", lambda: 0)
    _kernels.cuda_available.cache_clear()
    try:
        assert not _kernels.cuda_available() and not _kernels.cuda_available()
        assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1
        assert "sm_120" in caplog.records[0].message
    finally:
        _kernels.cuda_available.cache_clear()


def _layer_norm_backward(rows, width):
    """A LayerNorm's input gradient written out, as the exporter writes it: xhat = (x - mean) *
    rstd, gw = g * w, dx = (gw - mean(gw) - xhat * mean(gw * xhat)) * rstd; and sum(gw) as a
    second output (a row sum read elsewhere)."""
    f32 = ir.DataType.FLOAT
    x, g = (ir.Value(name=n, shape=ir.Shape([rows, width]), type=ir.TensorType(f32)) for n in "xg")
    w = ir.Value(name="w", shape=ir.Shape([width]), type=ir.TensorType(f32))
    mean, rstd = (ir.Value(name=n, shape=ir.Shape([rows, 1]), type=ir.TensorType(f32)) for n in ("mean", "rstd"))
    axes = ir.Value(name="axes", const_value=ir.tensor(np.array([-1], dtype=np.int64)),
                    shape=ir.Shape([1]), type=ir.TensorType(ir.DataType.INT64))
    centered = ir.node("Sub", [x, mean])
    xhat = ir.node("Mul", [centered.outputs[0], rstd])
    gw = ir.node("Mul", [g, w])
    m1 = ir.node("ReduceMean", [gw.outputs[0], axes], attributes={"keepdims": 1})
    prod = ir.node("Mul", [gw.outputs[0], xhat.outputs[0]])
    m2 = ir.node("ReduceMean", [prod.outputs[0], axes], attributes={"keepdims": 1})
    total = ir.node("ReduceSum", [gw.outputs[0], axes], attributes={"keepdims": 1})
    less = ir.node("Sub", [gw.outputs[0], m1.outputs[0]])
    along = ir.node("Mul", [xhat.outputs[0], m2.outputs[0]])
    diff = ir.node("Sub", [less.outputs[0], along.outputs[0]])
    dx = ir.node("Mul", [diff.outputs[0], rstd])
    dx.outputs[0].name, total.outputs[0].name = "dx", "total"
    nodes = [centered, xhat, gw, m1, prod, m2, total, less, along, diff, dx]
    graph = ir.Graph([x, g, w, mean, rstd], [dx.outputs[0], total.outputs[0]], nodes=nodes, initializers=[axes],
                     opset_imports={"": 18})
    return ir.Model(graph, ir_version=10)


@pytest.mark.parametrize("rows, width, grid, block", [(6, 100, 4, 8), (33, 768, 5, 32), (3, 7, 2, 16)])
def test_a_cuda_row_kernel_sums_each_row_across_its_block_as_a_norms_backward_needs(tmp_path, rows, width, grid,
                                                                                    block):
    """A norm's backward as one CUDA kernel: a block per row, each phase's row sums added up
    across the block's threads (more threads than lanes included), rows strided over fewer
    blocks than rows; a row sum read outside is an output of shape [rows, 1]."""
    model = _layer_norm_backward(rows, width)
    kernels = _pointwise.fuse_pointwise(model, device="cuda")
    assert [n.domain for n in model.graph] == [_pointwise.DOMAIN] and "PW_CUDA_ROW_ENTRY" in kernels[0]
    meta = json.loads(kernels[0].splitlines()[0].split("kernel ", 1)[1])
    outputs = [v.name for v in model.graph[0].outputs]  # in the kernel's order
    assert sorted(outputs) == ["dx", "total"] and meta["out_kinds"][outputs.index("total")] == 1
    library, [name] = _cuda_kernels_on_cpu(kernels, str(tmp_path))
    torch.manual_seed(0)
    order = [v.name for v in model.graph[0].inputs]  # the kernel's own order
    for rows_now, width_now in ((rows, width), (rows + 5, width // 2 + 1)):  # run-time shapes need not be static
        x, g, w = torch.randn(rows_now, width_now), torch.randn(rows_now, width_now), torch.randn(width_now)
        mean, rstd = x.mean(-1, keepdim=True), torch.rsqrt(x.var(-1, keepdim=True, unbiased=False) + 1e-5)
        by_name = {"x": x, "g": g, "w": w, "mean": mean, "rstd": rstd}
        got = dict(zip(outputs, _run_cuda_kernel_on_cpu(library, name, [by_name[n] for n in order], [torch.float32] * 2,
                                                        grid=grid, block=block, out_kinds=meta["out_kinds"])))
        xhat, gw = (x - mean) * rstd, g * w
        want = (gw - gw.mean(-1, keepdim=True) - xhat * (gw * xhat).mean(-1, keepdim=True)) * rstd
        torch.testing.assert_close(got["dx"], want, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got["total"], gw.sum(-1, keepdim=True), rtol=1e-5, atol=1e-4)


def test_a_group_never_reads_a_path_that_leaves_through_an_earlier_group_and_comes_back():
    """CLIP's loss backward under dynamic=True. ``a``'s group gains a late node reading ``g``'s
    product, so whatever reads ``a`` reads ``g`` too; ``g + (a @ w)`` must then not join ``g``.
    The join check had skipped ``a @ w`` as computed before ``g``: the two kernels waited on
    each other, the fusion pass failed ("Graph contains a cycle") and the partition lost all
    its kernels."""
    def value(name):
        return ir.Value(name=name, shape=ir.Shape([128, 128]), type=ir.TensorType(ir.DataType.FLOAT))

    x, y, w, w2 = value("x"), value("y"), value("w"), value("w2")
    a = ir.node("Relu", [x])
    a_product = ir.node("MatMul", [a.outputs[0], w])
    g = ir.node("Sigmoid", [y])
    g_product = ir.node("MatMul", [g.outputs[0], w2])
    a_late = ir.node("Mul", [a.outputs[0], g_product.outputs[0]])
    g_late = ir.node("Add", [g.outputs[0], a_product.outputs[0]])
    nodes = [a, a_product, g, g_product, a_late, g_late]
    for node in nodes:
        node.outputs[0].shape, node.outputs[0].type = ir.Shape([128, 128]), ir.TensorType(ir.DataType.FLOAT)
    graph = ir.Graph([x, y, w, w2], [a_late.outputs[0], g_late.outputs[0]], nodes=nodes, opset_imports={"": 18})

    groups, _ = _pointwise._groups(graph)
    assert [[n.op_type for n in group.nodes] for group in groups] == [["Relu", "Mul"], ["Sigmoid"], ["Add"]]
    ops, session = _after_pointwise_stage(ir.Model(graph, ir_version=10))
    assert "Relu" not in ops  # a's group is a kernel
    rng = np.random.default_rng(0)
    feeds = {name: rng.standard_normal((128, 128)).astype(np.float32) for name in ("x", "y", "w", "w2")}
    relu, sigmoid = np.maximum(feeds["x"], 0), 1 / (1 + np.exp(-feeds["y"]))
    got = session.run(None, feeds)
    np.testing.assert_allclose(got[0], relu * (sigmoid @ feeds["w2"]), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[1], sigmoid + relu @ feeds["w"], rtol=1e-5, atol=1e-5)


def _expands_of_the_last_axis(path) -> list:
    """Expands in a saved model whose input's last axis is 1 and result's is not."""
    model = ir.load(path)
    return [n for n in model.graph if n.op_type == "Expand" and n.inputs[0].shape is not None
            and n.outputs[0].shape is not None and len(n.inputs[0].shape) and n.inputs[0].shape[-1] == 1
            and n.outputs[0].shape[-1] != 1]


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("op", [
    lambda x: x.mean((-1, -2), keepdim=True),  # ResNet's pooler: its gradient fills each plane
    lambda x: F.adaptive_avg_pool2d(x, 4),     # windows of 4 x 4: each value spread over one
    lambda x: x.sum() * 3 + x.mean(),          # a scalar's gradients over everything
], ids=["plane_mean", "adaptive_avg", "scalar"])
def test_an_expand_of_the_last_axis_is_a_product_by_ones_with_eagers_exact_values(tmp_path, op, dynamic):
    """ORT's Expand fills a result whose last axis it broadcasts a few floats at a time (a
    plane mean's gradient: 0.61 of the pooler's 1.5 ms step, layer_ops adaptive_avg_head). It is
    now a MatMul by a row of ones, then an Expand of whole rows: every element ``g * 1``, so the
    gradients are eager's exactly, infinities and NaN where eager has them too."""
    x = torch.randn(4, 32, 16, 16, requires_grad=True)

    def fn(t, w):
        return (op(t) * w).sum()

    w = torch.randn(op(x).shape)
    if w.dim():
        w.view(-1)[:3] = torch.tensor([float("inf"), float("-inf"), float("nan")])
    eager = torch.autograd.grad(fn(x, w), x)[0]
    ort_dynamo.reset()
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="ort", dynamic=dynamic or None,
                             options={"save_onnx": True, "save_path": str(tmp_path)})
    torch.autograd.grad(compiled(x, w), x)
    ort_dynamo.wait_for_kernels()
    got = torch.autograd.grad(compiled(x, w), x)[0]
    torch.testing.assert_close(got, eager, rtol=0, atol=0, equal_nan=True)
    backward = glob.glob(str(tmp_path / "*backward*.onnx"))
    assert backward and not any(_expands_of_the_last_axis(p) for p in backward)
    assert any(n.op_type == "MatMul" for p in backward for n in onnx.load(p).graph.node)
    assert ort_dynamo.report().fallback_nodes == 0


def test_a_transpose_undone_by_the_next_is_neither():
    """A partition's input in the layout a kernel of the run before wrote it, moved back and
    forth (ORT would cancel the pair itself, but not once they are MergeHeads): no copy."""
    x = ir.Value(name="x", shape=ir.Shape([2, 5, 3, 16]), type=ir.TensorType(ir.DataType.FLOAT))
    there = ir.node("Transpose", [x], attributes={"perm": [0, 2, 1, 3]})
    back = ir.node("Transpose", [there.outputs[0]], attributes={"perm": [0, 2, 1, 3]})
    relu = ir.node("Relu", [back.outputs[0]])
    relu.outputs[0].name, relu.outputs[0].dtype = "y", ir.DataType.FLOAT
    model = ir.Model(ir.Graph([x], relu.outputs, nodes=[there, back, relu], opset_imports={"": 18}), ir_version=10)
    ops, session = _after_pointwise_stage(model)
    assert not {"Transpose", "MergeHeads"} & set(ops), ops
    xs = np.random.randn(2, 5, 3, 16).astype(np.float32)
    np.testing.assert_array_equal(session.run(None, {"x": xs})[0], np.maximum(xs, 0))
