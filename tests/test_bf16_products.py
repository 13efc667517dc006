"""CPU autocast's matrix products as bfloat16 ones (csrc/bf16_gemm.h), as eager computes them.

Under ``torch.autocast("cpu", dtype=torch.bfloat16)`` a product's operands are bfloat16 and its
result is rounded to bfloat16. ORT's CPU provider has float32 GEMMs only, so the exported graph
multiplies the operands as float32 between Casts; where the compiler targets AVX512-BF16 that
MatMul becomes a ``Bf16MatMul`` kernel, which multiplies with the instruction eager's oneDNN
kernels use and sums in float32. Built from the same code, float32 products with a long inner
dimension become ``F32MatMul`` kernels (the end of this file).
"""
import copy
import os

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch

from ort_dynamo import _kernels, _pointwise

bf16_kernels = pytest.mark.skipif(not (_kernels.available() and _kernels.bfloat16_products()),
                                  reason="no C compiler targeting AVX512-BF16 here")
f32_kernels = pytest.mark.skipif(not (_kernels.available() and _kernels.float32_products()),
                                 reason="no C compiler targeting AVX-512 here")


def _float(name, shape):
    return ir.Value(name=name, shape=ir.Shape(shape), type=ir.TensorType(ir.DataType.FLOAT))


def _node(op, inputs, dtype, shape, **attributes):
    node = ir.node(op, inputs, attributes=attributes)
    node.outputs[0].dtype, node.outputs[0].shape = dtype, ir.Shape(shape)
    return node


def _last_two_swapped(rank):
    return [*range(rank - 2), rank - 1, rank - 2]


def _autocast_product(a_shape, b_shape, transpose_a=False, transpose_b=False, operands_bf16=True, rounded=True,
                      b_perm=None, reader="float"):
    """The graph of ``a @ b`` as CPU autocast's look after ``rewrite``: each operand rounded to
    bfloat16 and widened back (``operands_bf16``), a Transpose of its last two axes where asked
    (of ``b_perm``'s axes for b), a float32 MatMul, and its result rounded to bfloat16
    (``rounded``). ``reader``: "float", read as float32; "bfloat16", first by a bfloat16 Concat
    of it with itself; "bias", with a bias (input "bias") added before the rounding;
    "transposed", read as float32 by a Transpose of its last two axes; "transposed twice", by
    two."""
    nodes, values = [], []
    b_perm = b_perm or (_last_two_swapped(len(b_shape)) if transpose_b else None)
    a_perm = _last_two_swapped(len(a_shape)) if transpose_a else None
    for name, shape, perm in (("a", a_shape, a_perm), ("b", b_shape, b_perm)):
        value = _float(name, shape)
        values.append(value)
        if operands_bf16:
            nodes += [_node("Cast", [value], ir.DataType.BFLOAT16, shape, to=ir.DataType.BFLOAT16)]
            nodes += [_node("Cast", [nodes[-1].outputs[0]], ir.DataType.FLOAT, shape, to=ir.DataType.FLOAT)]
            value = nodes[-1].outputs[0]
        if perm:
            nodes.append(_node("Transpose", [value], ir.DataType.FLOAT, [shape[i] for i in perm], perm=perm))
        values.append(nodes[-1].outputs[0] if perm else value)
    a_view, b_view = values[1], values[3]
    out_shape = [*np.broadcast_shapes(tuple(a_view.shape[:-2]), tuple(b_view.shape[:-2])),
                 a_view.shape[-2], b_view.shape[-1]]
    nodes.append(_node("MatMul", [a_view, b_view], ir.DataType.FLOAT, out_shape))
    inputs = [values[0], values[2]]
    if reader == "bias":
        inputs.append(_float("bias", out_shape[-1:]))
        nodes.append(_node("Add", [nodes[-1].outputs[0], inputs[-1]], ir.DataType.FLOAT, out_shape))
    if rounded:
        nodes.append(_node("Cast", [nodes[-1].outputs[0]], ir.DataType.BFLOAT16, out_shape, to=ir.DataType.BFLOAT16))
        if reader == "bfloat16":
            out_shape = [*out_shape[:-1], 2 * out_shape[-1]]
            nodes.append(_node("Concat", [nodes[-1].outputs[0]] * 2, ir.DataType.BFLOAT16, out_shape, axis=-1))
        nodes.append(_node("Cast", [nodes[-1].outputs[0]], ir.DataType.FLOAT, out_shape, to=ir.DataType.FLOAT))
    for _ in range({"transposed": 1, "transposed twice": 2}.get(reader, 0)):
        out_shape = [*out_shape[:-2], out_shape[-1], out_shape[-2]]
        nodes.append(_node("Transpose", [nodes[-1].outputs[0]], ir.DataType.FLOAT, out_shape,
                           perm=_last_two_swapped(len(out_shape))))
    nodes[-1].outputs[0].name = "c"
    graph = ir.Graph(inputs, [nodes[-1].outputs[0]], nodes=nodes, opset_imports={"": 18})
    return ir.Model(graph, ir_version=10)


def _fused(model, supported=True):
    """The kernels and the op types, a bfloat16 product's named by its layout alone
    (``Bf16MatMulNT``: its operands' and result's types are a suffix)."""
    kernels = _pointwise.fuse_pointwise(model, lambda: supported)
    return kernels, [n.op_type.split("_")[0] for n in model.graph]


def _run(model, kernels, a, b, **more):
    so = ort.SessionOptions()
    so.register_custom_ops_library(_kernels.library(kernels))
    session = ort.InferenceSession(ir.serde.serialize_model(model).SerializeToString(), so,
                                   providers=["CPUExecutionProvider"])
    return session.run(None, {"a": a, "b": b, **more})[0]


def _bf16_values(*shape, scale=1.0):
    return (torch.randn(*shape) * scale).bfloat16().float().numpy()


def _reference(a, b, transpose_a, transpose_b):
    """The exact product in float64 and the magnitude of its terms (|a| @ |b|)."""
    a, b = torch.from_numpy(a).double(), torch.from_numpy(b).double()
    a, b = (a.transpose(-1, -2) if transpose_a else a), (b.transpose(-1, -2) if transpose_b else b)
    return (a @ b).numpy(), (a.abs() @ b.abs()).numpy()


@bf16_kernels
@pytest.mark.parametrize("a_shape, b_shape, transpose_a, transpose_b", [
    ((1, 1), (1, 1), False, False),
    ((7, 3), (3, 5), False, False),           # smaller than one register tile
    ((37, 129), (129, 50), False, False),     # odd K: a pair half padded
    ((100, 300), (70, 300), False, True),     # K past one block (256), a Linear's weight
    ((600, 13), (600, 33), True, False),      # a weight gradient: the tokens are K
    ((45, 61), (70, 45), True, True),
    ((3, 37, 64), (3, 64, 50), False, False),  # batched, as attention's products
    ((2, 1, 19, 16), (3, 7, 16), False, True),  # batch axes that broadcast
    ((4, 33, 40), (40, 65), False, False),    # a Linear on 3-D input: all rows one product
    ((33, 40), (4, 40, 65), False, False),    # the same A for every batch
    ((3, 8, 256), (3, 256, 6000), False, False),  # B packed in two chunks of columns (8 MB each at most)
])
def test_a_bfloat16_product_is_the_exact_product_summed_in_float32_then_rounded(a_shape, b_shape, transpose_a,
                                                                               transpose_b):
    torch.manual_seed(0)
    model = _autocast_product(a_shape, b_shape, transpose_a, transpose_b)
    kernels, ops = _fused(model)
    layout = ("T" if transpose_a else "N") + ("T" if transpose_b else "N")
    assert f"Bf16MatMul{layout}" in ops and "MatMul" not in ops and "Transpose" not in ops
    a, b = _bf16_values(*a_shape), _bf16_values(*b_shape)
    got = _run(model, kernels, a, b)
    exact, magnitude = _reference(a, b, transpose_a, transpose_b)
    assert got.shape == exact.shape
    # Rounding the float32 sum to bfloat16 (half a unit in the 8th bit), plus float32's
    # accumulation error; a misplaced element or a dropped term is off by far more.
    bound = 2.0 ** -8 * np.abs(exact) + 2.0 ** -20 * magnitude
    assert (np.abs(got - exact) <= bound).all(), np.abs(got - exact).max()


@bf16_kernels
@pytest.mark.parametrize("reader, form", [
    ("float", "_bbfr"),     # only float32 ops read the rounded result: stored rounded, as float32
    ("bfloat16", "_bbb"),   # a bfloat16 op (a Concat) reads it: stored as bfloat16
    ("bias", "_bbfr_bias"),  # a Linear's bias added to the float32 sums before the rounding
    ("transposed", "_bbfr"),  # read transposed: the operands multiplied the other way round
    ("transposed twice", "_bbfr"),  # t(t(c)), as a weight's gradient often is: c
])
def test_a_bfloat16_products_result_is_stored_as_its_readers_need_it(reader, form):
    torch.manual_seed(0)
    a, b, bias = _bf16_values(2, 37, 40), _bf16_values(40, 50), np.random.randn(50).astype(np.float32)
    model = _autocast_product(a.shape, b.shape, reader=reader)
    kernels, _ = _fused(model)
    products = [n.op_type for n in model.graph if n.op_type.startswith("Bf16MatMul")]
    layout = "TT" if reader == "transposed" else "NN"
    ops = [n.op_type for n in model.graph]
    assert products == [f"Bf16MatMul{layout}{form}"] and "MatMul" not in ops and "Transpose" not in ops
    got = _run(model, kernels, a, b, **({"bias": bias} if reader == "bias" else {}))
    exact = torch.from_numpy(a).double() @ torch.from_numpy(b).double() + (bias if reader == "bias" else 0)
    want = exact.float().bfloat16().float()  # float32 sums then rounded: within a unit of this
    want = {"bfloat16": torch.cat([want, want], -1), "transposed": want.transpose(-1, -2)}.get(reader, want).numpy()
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=2 ** -7, atol=1e-6)
    assert (torch.from_numpy(got).bfloat16().float().numpy() == got).all()  # bfloat16 values


@bf16_kernels
def test_a_bfloat16_product_keeps_nan_and_infinity_as_float32_products_do():
    torch.manual_seed(0)
    a, b = _bf16_values(20, 40), _bf16_values(40, 30)
    a[3, 7] = np.nan
    a[5, 0] = np.inf
    b[0, 2] = 0.0  # inf * 0: NaN in row 5, column 2
    b[11, 9] = -np.inf
    model = _autocast_product(a.shape, b.shape)
    kernels, _ = _fused(model)
    got = _run(model, kernels, a, b)
    want = (torch.from_numpy(a) @ torch.from_numpy(b)).numpy()
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.isposinf(got), np.isposinf(want))
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    assert np.isnan(got[3]).all() and np.isnan(got[5, 2])


@bf16_kernels
def test_empty_products_and_an_empty_inner_axis():
    for a_shape, b_shape, want in (((0, 8), (8, 5), np.zeros((0, 5))), ((4, 0), (0, 5), np.zeros((4, 5)))):
        model = _autocast_product(a_shape, b_shape)
        kernels, ops = _fused(model)
        assert "Bf16MatMulNN" in ops
        np.testing.assert_array_equal(_run(model, kernels, np.zeros(a_shape, np.float32), np.ones(b_shape, np.float32)),
                                      want)
    bias = np.array([1.5, -2.0, 3.0, 0.25, 1e-3], np.float32)
    want = np.broadcast_to(torch.from_numpy(bias).bfloat16().float().numpy(), (4, 5))
    for declared in ([5], ["n"]):  # a length the graph shows to be the columns', or a symbolic one
        model = _autocast_product((4, 0), (0, 5), reader="bias")
        model.graph.inputs[2].shape = ir.Shape(declared)
        kernels, _ = _fused(model)
        ops = [n.op_type for n in model.graph]
        # The kernel adds one value per column: a bias not known to have that many stays an Add.
        assert any(op.endswith("_bias") for op in ops) == (declared == [5]), ops
        got = _run(model, kernels, np.zeros((4, 0), np.float32), np.zeros((0, 5), np.float32), bias=bias)
        np.testing.assert_array_equal(got, want)


def test_only_autocasts_products_become_bfloat16_products():
    """Operands that are not bfloat16 values, a result not rounded to bfloat16 (a float32
    product of bfloat16 values is eager's float32 GEMM), or a compiler without AVX512-BF16:
    the MatMul stays. Whether the compiler targets it is asked only when there is a product."""
    asked = []
    for model in (_autocast_product((8, 16), (16, 4), operands_bf16=False),
                  _autocast_product((8, 16), (16, 4), rounded=False)):
        _, ops = _fused(model, supported=None)
        assert "MatMul" in ops and not any(op.startswith("Bf16MatMul") for op in ops)
    model = _autocast_product((8, 16), (16, 4))
    assert "MatMul" in _pointwise.fuse_pointwise(model, lambda: asked.append(1) or False) + \
        [n.op_type for n in model.graph] and asked == [1]


def test_transposes_before_a_product_fold_into_its_layout():
    """A weight gradient's ``t(t(w))`` is ``w``; a Transpose of other axes stays a Transpose."""
    model = _autocast_product((8, 16), (4, 16), transpose_b=True)
    graph = model.graph
    product = next(n for n in graph if n.op_type == "MatMul")
    transpose = product.inputs[1].producer()
    again = _node("Transpose", [transpose.outputs[0]], ir.DataType.FLOAT, [4, 16], perm=[1, 0])
    twice = _node("Transpose", [again.outputs[0]], ir.DataType.FLOAT, [16, 4], perm=[1, 0])
    graph.insert_before(product, [again, twice])
    product.replace_input_with(1, twice.outputs[0])
    _, ops = _fused(model)
    assert "Bf16MatMulNT" in ops and "Transpose" not in ops

    heads = _autocast_product((2, 4, 8, 16), (2, 16, 4, 8), b_perm=[0, 2, 1, 3])  # b: [batch, d, heads, seq]
    _, ops = _fused(heads)
    assert "Bf16MatMulNN" in ops and "Transpose" in ops


@bf16_kernels
def test_a_product_of_a_products_rounded_result_reads_it_as_stored():
    """``(a @ b) @ c``: the first result, read only as float32, is stored as float32 holding
    bfloat16 values, and the second product reads those floats (an attention's scores times
    its values reads the softmax's output alike)."""
    torch.manual_seed(0)
    model = _autocast_product((24, 40), (40, 30))
    graph = model.graph
    widened = graph.outputs[0]
    c = _float("c_in", [30, 20])
    graph.inputs.append(c)
    rounded_c = _node("Cast", [c], ir.DataType.BFLOAT16, [30, 20], to=ir.DataType.BFLOAT16)
    widened_c = _node("Cast", [rounded_c.outputs[0]], ir.DataType.FLOAT, [30, 20], to=ir.DataType.FLOAT)
    product = _node("MatMul", [widened, widened_c.outputs[0]], ir.DataType.FLOAT, [24, 20])
    rounded = _node("Cast", [product.outputs[0]], ir.DataType.BFLOAT16, [24, 20], to=ir.DataType.BFLOAT16)
    out = _node("Cast", [rounded.outputs[0]], ir.DataType.FLOAT, [24, 20], to=ir.DataType.FLOAT)
    graph.extend([rounded_c, widened_c, product, rounded, out])
    widened.name, out.outputs[0].name = "ab", "c"
    graph.outputs[0] = out.outputs[0]
    kernels, _ = _fused(model)
    assert [n.op_type for n in graph if n.op_type.startswith("Bf16")] == ["Bf16MatMulNN_bbfr", "Bf16MatMulNN_fbfr"]
    a, b, c_in = _bf16_values(24, 40), _bf16_values(40, 30), _bf16_values(30, 20)
    got = _run(model, kernels, a, b, c_in=c_in)
    ab = (torch.from_numpy(a) @ torch.from_numpy(b)).bfloat16().float()
    want = (ab @ torch.from_numpy(c_in)).bfloat16().float().numpy()
    np.testing.assert_allclose(got, want, rtol=2 ** -6, atol=1e-5)


@bf16_kernels
def test_a_bfloat16_result_is_reshaped_before_it_is_widened_for_the_kernel_that_reads_it():
    """Read as bfloat16 (here a Concat) and, through a Reshape, by float32 ops: the Reshape
    takes the bfloat16 result, so the Cast after it joins the kernel that reads it rather than
    being a pass of ORT's over the whole result (Llama's MLP: 0.96 of the step)."""
    torch.manual_seed(0)
    model = _autocast_product((1024, 40), (40, 48), reader="bfloat16")
    graph = model.graph
    rounded = next(n for n in graph if n.op_type == "Cast" and n.outputs[0].dtype == ir.DataType.BFLOAT16
                   and n.inputs[0].producer() is not None and n.inputs[0].producer().op_type == "MatMul").outputs[0]
    widened = _node("Cast", [rounded], ir.DataType.FLOAT, [1024, 48], to=ir.DataType.FLOAT)
    shape = ir.Value(name="heads", const_value=ir.tensor(np.array([1024, 4, 12], dtype=np.int64)))
    heads = _node("Reshape", [widened.outputs[0], shape], ir.DataType.FLOAT, [1024, 4, 12])
    scaled = _node("Mul", [heads.outputs[0], heads.outputs[0]], ir.DataType.FLOAT, [1024, 4, 12])
    scaled.outputs[0].name = "squares"
    graph.register_initializer(shape)
    graph.extend([widened, heads, scaled])
    graph.outputs.append(scaled.outputs[0])
    kernels, _ = _fused(model)
    product = next(n for n in graph if n.op_type.startswith("Bf16MatMul"))
    assert product.op_type == "Bf16MatMulNN_bbb"
    assert {u.node.op_type for u in product.outputs[0].uses()} == {"Concat", "Reshape"}
    assert not [n for n in graph if n.op_type == "Cast" and n.inputs[0].dtype == ir.DataType.BFLOAT16
                and n.inputs[0].producer() is not None and n.inputs[0].producer().op_type == "Reshape"]
    a, b = _bf16_values(1024, 40), _bf16_values(40, 48)
    so = ort.SessionOptions()
    so.register_custom_ops_library(_kernels.library(kernels))
    session = ort.InferenceSession(ir.serde.serialize_model(model).SerializeToString(), so,
                                   providers=["CPUExecutionProvider"])
    both, squares = session.run(None, {"a": a, "b": b})
    np.testing.assert_array_equal(squares, (both[:, :48] ** 2).reshape(1024, 4, 12))


def _f32_product_session(transposed, bias=False, ranks=(4, 3)):
    """ort_dynamo's float32 product (``F32MatMul*``) as a one-node model of operands of ``ranks``
    axes; ``bias``: a third input."""
    from ort_dynamo import _op_kernels

    name, unit = _op_kernels.f32_matmul_kernel(list(transposed), bias)
    inputs = [ir.Value(name=n, type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([f"{n}{i}" for i in range(r)]))
              for n, r in (("a", ranks[0]), ("b", ranks[1]), ("bias", 1))[:3 if bias else 2]]
    node = ir.node(name, inputs, domain=_op_kernels.DOMAIN)
    node.outputs[0].name, node.outputs[0].dtype = "c", ir.DataType.FLOAT
    graph = ir.Graph(inputs, node.outputs, nodes=[node], opset_imports={"": 18, _op_kernels.DOMAIN: 1})
    so = ort.SessionOptions()
    so.register_custom_ops_library(_kernels.library([unit]))
    return ort.InferenceSession(ir.serde.serialize_model(ir.Model(graph, ir_version=10)).SerializeToString(), so,
                                providers=["CPUExecutionProvider"])


@f32_kernels
@pytest.mark.parametrize("transposed", [(False, False), (False, True), (True, False)])
@pytest.mark.parametrize("m, k, n", [(13, 300, 45), (48, 256, 64), (30, 1, 33), (5, 0, 7)])
def test_our_float32_product_is_the_float32_product_over_broadcast_batches(transposed, m, k, n):
    """F32MatMul (not used by the rewrite yet; benchmarks/gemm.py --ours measures it): float32
    products summed in float32, over K blocks and tails, partial tiles and panels, a batch axis
    broadcast from each side, and an empty K (zeros plus the bias)."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((2, 1, k, m) if transposed[0] else (2, 1, m, k)).astype(np.float32)
    b = rng.standard_normal((3, n, k) if transposed[1] else (3, k, n)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    got = _f32_product_session(transposed, bias=True).run(None, {"a": a, "b": b, "bias": bias})[0]
    a64 = np.swapaxes(a, -1, -2) if transposed[0] else a
    b64 = np.swapaxes(b, -1, -2) if transposed[1] else b
    want = np.matmul(a64.astype(np.float64), b64.astype(np.float64)) + bias
    assert got.shape == (2, 3, m, n)
    # float32 sums of k products: within k float32 roundings of the exact sums' magnitude
    scale = np.matmul(np.abs(a64).astype(np.float64), np.abs(b64).astype(np.float64)) + np.abs(bias)
    assert np.all(np.abs(got - want) <= (k + 2) * np.finfo(np.float32).eps * scale + 1e-30)
    plain = _f32_product_session(transposed).run(None, {"a": a, "b": b})[0]
    np.testing.assert_allclose(plain, got - bias, rtol=0, atol=1e-5 * (1 + np.abs(want).max()))


@f32_kernels
@pytest.mark.parametrize("transpose_b", [False, True])
@pytest.mark.parametrize("rows, k, n", [((1,), 17, 3), ((5,), 300, 45), ((2, 8), 256, 1024), ((3, 9), 1, 64),
                                        ((32,), 64, 100), ((4,), 0, 7), ((33,), 40, 70)])
def test_our_float32_product_of_few_rows_reads_b_in_place_and_is_the_float32_product(transpose_b, rows, k, n):
    """Up to 32 rows against one matrix (an RNN's step; the leading axes are rows too) take the
    path that reads B in place, its columns split over the threads; 33 rows the packed one.
    Tails of rows, columns and K, an empty K (the bias alone), with and without a bias."""
    rng = np.random.default_rng(1)
    a = rng.standard_normal((*rows, k)).astype(np.float32)
    b = rng.standard_normal((n, k) if transpose_b else (k, n)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    ranks = (len(rows) + 1, 2)
    got = _f32_product_session((False, transpose_b), bias=True, ranks=ranks).run(
        None, {"a": a, "b": b, "bias": bias})[0]
    b64 = (b.T if transpose_b else b).astype(np.float64)
    want = np.matmul(a.astype(np.float64), b64) + bias
    assert got.shape == (*rows, n)
    scale = np.matmul(np.abs(a).astype(np.float64), np.abs(b64)) + np.abs(bias)
    assert np.all(np.abs(got - want) <= (k + 2) * np.finfo(np.float32).eps * scale + 1e-30)
    plain = _f32_product_session((False, transpose_b), ranks=ranks).run(None, {"a": a, "b": b})[0]
    np.testing.assert_allclose(plain, got - bias, rtol=0, atol=1e-5 * (1 + np.abs(want).max()))


@f32_kernels
@pytest.mark.parametrize("a_shape, b_shape, transpose_a, transpose_b, ours", [
    ((512, 600), (600, 40), False, False, "F32MatMulNN"),
    ((2, 256, 600), (40, 600), False, True, "F32MatMulNT"),  # a Linear's weight, its Transpose folded in
    ((600, 512), (600, 40), True, False, None),    # A transposed (a weight gradient): ORT's was as fast
    ((512, 256), (256, 40), False, False, None),   # K=256: ORT's was faster
    ((64, 600), (600, 40), False, False, None),    # 64 rows (a convolution's weight gradient): ORT's was faster
    ((16, 256), (1024, 256), False, True, "F32MatMulNT"),  # an LSTM step's 16 rows: B read in place
    ((2, 8, 256), (256, 1024), False, False, "F32MatMulNN"),  # ... its backward; leading axes are rows
    ((48, 256), (256, 40), False, False, None),    # 48 rows, K=256: ORT's
    ((2, 16, 256), (2, 256, 40), False, False, None),  # B a batch of matrices: ORT's
])
def test_a_float32_product_with_a_long_inner_dimension_is_ours_where_it_measured_faster(
        a_shape, b_shape, transpose_a, transpose_b, ours):
    """Float32 MatMuls with a static K of at least F32_MIN_K, A's rows in memory and at least
    F32_MIN_M of them (a leading axis counts where B is one matrix), or with at most
    F32_SKINNY_M rows known and B one matrix, become F32MatMul
    (``benchmarks/gemm.py --ours``); the others stay ORT's. Either way the float32
    product, summed in float32."""
    torch.manual_seed(0)
    model = _autocast_product(a_shape, b_shape, transpose_a, transpose_b, operands_bf16=False, rounded=False)
    kernels, ops = _fused(model)
    if ours:
        assert ours in ops and "MatMul" not in ops and "Transpose" not in ops, ops
    else:
        assert "MatMul" in ops and not any(op.startswith("F32MatMul") for op in ops), ops
    a, b = torch.randn(*a_shape).numpy(), torch.randn(*b_shape).numpy()
    got = _run(model, kernels, a, b)
    exact, magnitude = _reference(a, b, transpose_a, transpose_b)
    inner = a_shape[-2 if transpose_a else -1]
    assert np.all(np.abs(got - exact) <= (inner + 2) * np.finfo(np.float32).eps * magnitude)
    assert _fused(_autocast_product(a_shape, b_shape, transpose_a, transpose_b, operands_bf16=False, rounded=False),
                  supported=False)[1].count("MatMul") == 1  # no AVX512-BF16 compiler: ORT's product


@bf16_kernels
def test_a_bias_of_another_length_than_the_products_columns_stays_an_add():
    """A bfloat16 ``baddbmm`` whose input broadcasts from one value: its Add was taken into the
    product as a bias, which the kernel adds per output column, so it refused the run ("the bias
    must have one value per output column") and the partition ran in PyTorch."""
    import ort_dynamo

    torch.manual_seed(0)
    a, b = torch.randn(5, 5, 5, dtype=torch.bfloat16), torch.randn(5, 5, 10, dtype=torch.bfloat16)
    for bias in (torch.randn(1, dtype=torch.bfloat16), torch.randn(10, dtype=torch.bfloat16)):
        ort_dynamo.reset()
        torch._dynamo.reset()
        got = torch.compile(torch.baddbmm, backend="ort")(bias, a, b)
        assert ort_dynamo.report().fallback_nodes == 0, str(ort_dynamo.report())
        torch.testing.assert_close(got, torch.baddbmm(bias, a, b), rtol=2e-2, atol=2e-2)


def _weight_gradient_in_float64(conv, x):
    """The layer's weight gradient for the loss ``conv(x).square().sum()``, in float64, and the
    magnitude of its terms (each |x| |dy| summed, as the same convolution of |x| by |dy|)."""
    layer = copy.deepcopy(conv).double()
    out = layer(x.detach().double())
    (out.square().sum()).backward()
    grad_out = 2 * out.detach()
    _, magnitude, _ = torch.ops.aten.convolution_backward(
        grad_out.abs(), x.detach().double().abs(), layer.weight.detach(), None, layer.stride, layer.padding,
        layer.dilation, isinstance(conv, torch.nn.modules.conv._ConvTransposeNd), layer.output_padding, 1,
        [False, True, False])
    return layer.weight.grad, magnitude


@f32_kernels
@pytest.mark.parametrize("conv, shape", [
    (torch.nn.Conv2d(6, 40, 3, padding=1), (2, 6, 24, 25)),       # K over one chunk; two panels of 32
    (torch.nn.Conv2d(4, 8, 3, padding=1), (2, 4, 6, 32)),          # rows of whole vectors: a last lane outside
    (torch.nn.Conv2d(3, 8, 3, padding=1), (4, 3, 64, 72)),         # few rows, long K: parts of two chunks each
    (torch.nn.Conv2d(5, 7, 4, stride=2, padding=1), (3, 5, 16, 17)),  # DCGAN's: stride, even window
    (torch.nn.Conv2d(4, 6, (3, 2), stride=(2, 1), padding=(2, 1), dilation=(2, 1)), (2, 4, 9, 10)),
    (torch.nn.Conv2d(3, 8, 7, stride=2, padding=3), (2, 3, 21, 20)),  # a stem: more taps than the window
    (torch.nn.Conv1d(6, 5, 3, stride=3, padding=2), (2, 6, 50)),
    (torch.nn.Conv3d(3, 4, 3, padding=1), (2, 3, 4, 5, 9)),
    (torch.nn.ConvTranspose2d(6, 4, 3, stride=2, padding=1, output_padding=1), (2, 6, 9, 10)),
])
def test_a_convolutions_weight_gradient_is_one_product_reading_its_columns_from_the_input(tmp_path, conv, shape):
    """With products of ort_dynamo's own, a one-group convolution's weight gradient is one
    ``TorchConvWeightGrad`` kernel: the output gradient times the input's columns, which it
    reads from the input as it packs them, where the columns stacked by Slices and a Concat
    took half the step (layer_ops conv3x3_64: 1.57 -> 1.17 times eager). 1-, 2- and 3-D,
    padding, stride, dilation, a transposed convolution's (input and gradient trade places);
    within float32's rounding of the exact sum, before the kernels (ORT's Conv) and after."""
    import glob

    import onnx

    import ort_dynamo

    torch.manual_seed(0)
    x = torch.randn(*shape)
    exact, magnitude = _weight_gradient_in_float64(conv, x)
    ort_dynamo.reset()
    torch._dynamo.reset()
    compiled = torch.compile(lambda t: conv(t).square().sum(), backend="ort",
                             options={"save_onnx": True, "save_path": str(tmp_path)})
    terms = x[0, 0].numel() * x.shape[0]
    for step in range(2):
        conv.weight.grad = None
        compiled(x).backward()
        error = (conv.weight.grad.double() - exact).abs()
        assert torch.all(error <= (terms + 2) * np.finfo(np.float32).eps * magnitude), (step, error.max())
        ort_dynamo.wait_for_kernels()
    assert ort_dynamo.report().fallback_nodes == 0, str(ort_dynamo.report())
    graph = onnx.load(glob.glob(str(tmp_path / "*backward*.onnx"))[0]).graph
    backward = [n.op_type for n in graph.node]
    assert sum(op.startswith("TorchConvWeightGrad_") for op in backward) == 1 and "Conv" not in backward, backward
    # Taps past the window (a stride-2 layer over an even size has them) are left out, not
    # computed and cut: the kernel's output is the gradient, of the window's taps.
    kernel = next(n for n in graph.node if n.op_type.startswith("TorchConvWeightGrad_"))
    output = next(o for o in graph.output if o.name == kernel.output[0])
    assert [d.dim_value for d in output.type.tensor_type.shape.dim][2:] == list(conv.weight.shape[2:]), output


@f32_kernels
def test_output_rows_shorter_than_8_keep_the_weight_gradients_columns_form(tmp_path):
    """Where the output's rows are shorter than 8 positions (ResNet's last stages at 64 x 64
    images) the kernel spent more packing its rows than multiplying them: the columns stacked
    by Slices and a Concat, and a MatMul, as without the kernel."""
    import glob

    import onnx

    import ort_dynamo

    conv = torch.nn.Conv2d(8, 8, 3, padding=1)
    ort_dynamo.reset()
    torch._dynamo.reset()
    torch.compile(lambda t: conv(t).square().sum(), backend="ort",
                  options={"save_onnx": True, "save_path": str(tmp_path)})(torch.randn(2, 8, 4, 4)).backward()
    ort_dynamo.wait_for_kernels()
    backward = [n.op_type for n in onnx.load(glob.glob(str(tmp_path / "*backward*.onnx"))[0]).graph.node]
    assert "Concat" in backward and not any(op.startswith("TorchConvWeightGrad_") for op in backward), backward


@f32_kernels
def test_a_convolutions_weight_gradient_kernel_takes_new_sizes_without_a_new_export(tmp_path):
    """Under ``dynamic=True`` the kernel reads every size at run time: other images and another
    batch reuse it, with the float64 gradient's values within float32's rounding, and K past
    several of its chunks of 1024 (2 x 40 x 41 positions). Here the forward saves the input with
    its first two axes swapped, as the Conv reads it: the kernel reads that layout."""
    import glob

    import onnx

    import ort_dynamo

    torch.manual_seed(0)
    conv = torch.nn.Conv2d(5, 9, 3, padding=1)
    ort_dynamo.reset()
    torch._dynamo.reset()
    compiled = torch.compile(lambda t: conv(t).square().sum(), backend="ort", dynamic=True,
                             options={"save_onnx": True, "save_path": str(tmp_path)})
    for shape in [(2, 5, 12, 13), (2, 5, 12, 13), (2, 5, 40, 41), (3, 5, 17, 9)]:
        x = torch.randn(*shape)
        exact, magnitude = _weight_gradient_in_float64(conv, x)
        conv.weight.grad = None
        compiled(x).backward()
        error = (conv.weight.grad.double() - exact).abs()
        assert torch.all(error <= (x[0, 0].numel() * x.shape[0] + 2) * np.finfo(np.float32).eps * magnitude), shape
        ort_dynamo.wait_for_kernels()
    assert ort_dynamo.report().exports == 2, str(ort_dynamo.report())  # one forward, one backward
    backward = [n.op_type for n in onnx.load(glob.glob(str(tmp_path / "*backward*.onnx"))[0]).graph.node]
    assert sum(op.startswith("TorchConvWeightGrad_") for op in backward) == 1 and "Conv" not in backward, backward


def _passes_in_float64(conv, x):
    """The layer's output and input gradient for the loss ``conv(x).square().sum()`` in float64,
    and their terms' magnitudes (the same convolutions of |x|, |w| and |dy|)."""
    layer = copy.deepcopy(conv).double()
    xd = x.detach().double().requires_grad_()
    out = layer(xd)
    out.square().sum().backward()
    magnitudes = copy.deepcopy(layer)
    with torch.no_grad():
        magnitudes.weight.abs_()
        if magnitudes.bias is not None:
            magnitudes.bias.abs_()
    out_magnitude = magnitudes(xd.detach().abs())
    grad_out = (2 * out.detach()).abs()
    probe = xd.detach().abs().requires_grad_()
    grad_magnitude = torch.autograd.grad(magnitudes(probe), probe, grad_out)[0]
    return out.detach(), out_magnitude, xd.grad, grad_magnitude


@f32_kernels
@pytest.mark.parametrize("conv, shape, kernels", [
    (torch.nn.Conv2d(16, 40, 3, padding=1), (2, 16, 24, 25), 2),        # M past one tile; the input gradient too
    (torch.nn.Conv2d(9, 20, 3, stride=2, padding=1), (3, 9, 15, 17), 1),   # stride 2: even columns picked out
    (torch.nn.Conv2d(8, 10, 4, stride=2, padding=1, bias=False), (2, 8, 16, 16), 1),  # DCGAN's
    (torch.nn.Conv2d(8, 9, (3, 2), stride=(1, 3), padding=(2, 1), dilation=(2, 1)), (2, 8, 9, 14), 1),  # gather
    (torch.nn.Conv2d(12, 9, 3, padding=2, dilation=2), (2, 12, 5, 3), 2),   # rows shorter than a half
    (torch.nn.Conv1d(10, 12, 3, padding=1), (3, 10, 50), 2),
    (torch.nn.Conv3d(8, 10, 3, padding=1), (2, 8, 4, 5, 9), 2),
    (torch.nn.ConvTranspose2d(9, 8, 3, padding=1), (2, 9, 11, 10), 2),     # a stride-1 ConvTranspose, and its gradient
    (torch.nn.Conv2d(16, 6, 3, padding=1), (2, 16, 10, 10), 0),   # 6 output channels (the input gradient's
])                                                                 # input): both passes stay ORT's
def test_a_convolution_and_its_input_gradient_are_products_reading_their_columns_from_the_input(
        tmp_path, conv, shape, kernels):
    """With products of ort_dynamo's own, a one-group convolution (and a stride-1 ConvTranspose,
    which is a convolution by the flipped, swapped weight: a stride-1 layer's input gradient) is
    one ``TorchConv`` kernel that packs its columns from the input, where ORT's Conv stores them
    and its ConvTranspose adds a col2im pass (layer_ops conv3x3_64: 1.2 -> 1.03-1.10 times
    eager's step). Output and input gradient within float32's rounding of the exact sums, before
    the kernels (ORT's ops) and after; ``kernels``: how many of the two passes it takes (a
    strided layer's input gradient stays ORT's ConvTranspose, and so does a pass with fewer than
    8 input or output channels)."""
    import glob

    import onnx

    import ort_dynamo

    torch.manual_seed(0)
    x = torch.randn(*shape, requires_grad=True)
    out, out_magnitude, grad, grad_magnitude = _passes_in_float64(conv, x)
    taps = conv.weight[0].numel()
    ort_dynamo.reset()
    torch._dynamo.reset()
    compiled = torch.compile(lambda t: conv(t), backend="ort", options={"save_onnx": True, "save_path": str(tmp_path)})
    eps = np.finfo(np.float32).eps
    for step in range(2):
        x.grad = None
        got = compiled(x)
        got.square().sum().backward()
        assert torch.all((got.double() - out).abs() <= (taps + 2) * eps * out_magnitude), step
        terms = taps * conv.weight.shape[0 if isinstance(conv, torch.nn.modules.conv._ConvTransposeNd) else 1]
        assert torch.all((x.grad.double() - grad).abs() <= (terms + 4) * 4 * eps * grad_magnitude), step
        ort_dynamo.wait_for_kernels()
    assert ort_dynamo.report().fallback_nodes == 0, str(ort_dynamo.report())
    ops = [n.op_type for path in glob.glob(str(tmp_path / "*.onnx")) for n in onnx.load(path).graph.node]
    assert sum(op.startswith("TorchConv_") for op in ops) == kernels, ops
    assert sum(op in ("Conv", "ConvTranspose") for op in ops) == 2 - kernels, ops  # the weight gradient's is ours


@f32_kernels
def test_one_by_one_and_three_channel_convolutions_stay_orts(tmp_path):
    """A 1x1 window is one product per image for ORT's Conv (1.6x faster than the kernel at
    MobileNet's 64 -> 192 channels), and a stem's 3 input channels share the kernel's per-tap
    work among too few rows: both stay ORT's Conv."""
    import glob

    import onnx

    import ort_dynamo

    for conv, shape in [(torch.nn.Conv2d(16, 24, 1), (2, 16, 9, 9)), (torch.nn.Conv2d(3, 16, 7, 2, 3), (2, 3, 32, 32))]:
        ort_dynamo.reset()
        torch._dynamo.reset()
        for path in glob.glob(str(tmp_path / "*.onnx")):
            os.remove(path)
        torch.compile(conv, backend="ort", options={"save_onnx": True, "save_path": str(tmp_path)})(
            torch.randn(*shape)).sum().backward()
        ort_dynamo.wait_for_kernels()
        forward = [n.op_type for n in onnx.load(glob.glob(str(tmp_path / "*forward*.onnx"))[0]).graph.node]
        assert "Conv" in forward and not any(op.startswith("TorchConv_") for op in forward), forward


@f32_kernels
def test_a_convolution_kernel_takes_new_sizes_without_a_new_export(tmp_path):
    """Under ``dynamic=True`` the kernel reads every size at run time: other images and another
    batch reuse the one export per direction, the output and gradients as eager's."""
    import glob

    import onnx

    import ort_dynamo

    torch.manual_seed(0)
    conv = torch.nn.Conv2d(8, 12, 3, padding=1)
    ort_dynamo.reset()
    torch._dynamo.reset()
    compiled = torch.compile(conv, backend="ort", dynamic=True, options={"save_onnx": True, "save_path": str(tmp_path)})
    for shape in [(2, 8, 12, 13), (2, 8, 12, 13), (2, 8, 40, 41), (3, 8, 17, 9)]:
        x = torch.randn(*shape, requires_grad=True)
        got = compiled(x)
        got.square().sum().backward()
        want_x = x.detach().clone().requires_grad_()
        want = conv(want_x)
        want.square().sum().backward()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(x.grad, want_x.grad, rtol=1e-4, atol=1e-4)
        ort_dynamo.wait_for_kernels()
    assert ort_dynamo.report().exports == 2, str(ort_dynamo.report())  # one forward, one backward
    ops = [n.op_type for path in glob.glob(str(tmp_path / "*.onnx")) for n in onnx.load(path).graph.node]
    assert sum(op.startswith("TorchConv_") for op in ops) == 2 and "Conv" not in ops, ops
