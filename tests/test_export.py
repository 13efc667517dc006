"""FX -> ONNX export: what the exported graph looks like, and that the shortcuts taken for
export speed (one constant per static view, type promotion without re-running every node)
keep the values eager computes."""

import onnxruntime as ort
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from ort_dynamo.export import export_graph


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
