"""FX -> ONNX export: what the exported graph looks like, and that the shortcuts taken for
export speed (one constant per static view, type promotion without re-running every node)
keep the values eager computes."""

import onnxruntime as ort
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from ort_dynamo.export import export_graph
from parity import partition_runner


def _run(exported, *inputs):
    import onnx_ir as ir

    session = ort.InferenceSession(ir.serde.serialize_model(exported.model).SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    feeds = dict(zip(exported.input_names, (x.numpy() for x in inputs)))
    return [torch.from_numpy(out) for out in session.run(None, feeds)]


def test_a_static_view_exports_as_one_reshape_of_a_constant_shape():
    def fn(x):
        return (x.view(5, 4) * 2).view(-1, 2)

    gm = make_fx(fn, tracing_mode="fake")(torch.randn(4, 5))
    exported = export_graph(gm)
    ops = [node.op_type for node in exported.model.graph]
    assert ops.count("Reshape") == 2 and "Concat" not in ops, ops
    x = torch.randn(4, 5)
    torch.testing.assert_close(_run(exported, x)[0], fn(x))


def test_a_view_of_a_symbolic_size_still_exports():
    def fn(x):
        return x.view(x.shape[0] * 5) + 1

    gm = make_fx(fn, tracing_mode="symbolic")(torch.randn(4, 5))
    exported = export_graph(gm)
    x = torch.randn(7, 5)
    torch.testing.assert_close(_run(exported, x)[0], fn(x))


def test_mixed_dtypes_get_the_casts_torch_does_implicitly():
    def fn(x, i):
        # float * int64, int64 / int (true division: float), and a comparison of both
        return x * i, i / 2, (x < i).sum(), torch.where(x > 0, x, i)

    x, i = torch.randn(3, 4), torch.randint(-3, 3, (3, 4))
    gm = make_fx(fn, tracing_mode="fake")(x, i)
    exported = export_graph(gm)
    for actual, expected in zip(_run(exported, x, i), fn(x, i)):
        assert actual.dtype == expected.dtype
        torch.testing.assert_close(actual, expected)


def test_python_floats_in_float64_graphs_are_exact():
    # A scalar no tensor input typed became a float32 constant: x * 0.1 was x * float32(0.1),
    # 1.5e-8 off in float64; clamp_min(1e-12) clamped at 9.99999996e-13; nan_to_num(inf)
    # gave inf, not float64's largest value.
    import ort_dynamo

    def fn(x):
        return (x * 0.1, 0.3 - x, torch.where(x > 2, x, 0.1), x.clamp_min(1e-12), x.nan_to_num(),
                torch.full_like(x, 0.1) + x)

    x = torch.tensor([1.0, 3.0, 1e-13, 7.0, float("inf"), -float("inf")], dtype=torch.float64)
    ort_dynamo.reset()
    actual = torch.compile(fn, backend="ort", options={"fallback_policy": "DISABLE"})(x)
    for a, e in zip(actual, fn(x)):
        assert a.dtype == torch.float64 and torch.equal(a, e), (a, e)


def test_an_output_eager_has_as_a_permuted_view_keeps_eagers_strides():
    """``(x * 2).transpose(1, 2)`` is a view in eager: ORT returns the product in its own
    layout and PyTorch permutes it, so strides (and a reader's layout) match eager's."""
    def fn(x):
        return (x * 2).transpose(1, 2)

    exported, runner = partition_runner(fn, torch.randn(2, 3, 4))
    assert [slot.kind for slot in exported.slots] == ["permute"], exported.slots
    x = torch.randn(2, 3, 4)
    got, want = runner(x), fn(x)
    torch.testing.assert_close(got, want)
    assert got.stride() == want.stride(), (got.stride(), want.stride())


def test_under_dynamic_shapes_a_permuted_output_keeps_eagers_strides_at_every_size():
    """Symbolic strides are ordered by their traced values: a new size reuses the export and
    still returns eager's layout, not a contiguous copy."""
    import ort_dynamo

    ort_dynamo.reset()
    step = torch.compile(lambda x: (x * 2).transpose(1, 2).sin(), backend="ort", dynamic=True)
    for shape in ((2, 3, 4), (3, 5, 7)):
        x = torch.randn(shape)
        got, want = step(x), (x * 2).transpose(1, 2).sin()
        torch.testing.assert_close(got, want)
        assert got.stride() == want.stride(), (got.stride(), want.stride())
    assert ort_dynamo.report().exports == 1


def test_a_transposed_input_comes_back_as_a_tensor_of_its_own_with_eagers_strides():
    """``x.t()`` of a graph input: in its buffer's layout it is the input itself, so ORT
    returns a copy of it (never the caller's buffer), which PyTorch permutes as eager would."""
    def fn(x):
        return x.t()

    exported, runner = partition_runner(fn, torch.randn(3, 4))
    x = torch.randn(3, 4)
    got = runner(x)
    torch.testing.assert_close(got, x.t())
    assert got.data_ptr() != x.data_ptr()
    assert got.stride() == x.t().stride()
