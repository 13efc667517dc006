"""ORT's Transpose against the ``TransposeRows`` kernel, one op per session, on permutations
convolutional and attention layers give them; says which of them the pointwise stage hands to
the kernel (``_op_kernels._moves_elementwise``), or to ``MergeHeads`` (``_op_kernels.moves_heads``:
attention's heads back into rows). Then ORT's Transpose against ``MergeHeads``, and three
Transposes and a Concat (GPT-2's q, k and v gradients) against ``ConcatHeads3``, on attention's
output as the CPU benchmark models have it, and GPT-2's projection split into q, k and v heads
(ORT's Split and a bias kernel per part) against ``SplitHeads3Bias``: warm and with the caches
evicted before each call. Last, Transposes that move an axis of size 1 (torch's einsum's, XLNet's
attention) before and after ``_op_kernels.transposes_without_unit_axes``, the same two ways.

    .venv/bin/python benchmarks/transposes.py
    .venv/bin/python benchmarks/transposes.py --bfloat16   # bfloat16 tensors (CPU autocast's)

Each session runs the one op 20 times after 3 warm-up runs, on the session's two intra-op
threads, and checks its result against numpy's (torch's for bfloat16); prints the mean ms of
each and ort/kernel. ``--bfloat16`` also prints ORT's float32 Transpose of the same shape, and
which of them the stage hands to ``TransposeRowsBf16`` (``_op_kernels._bfloat16_moves_slowly``).
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ort_dynamo import _kernels, _op_kernels, _pointwise  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gemm import _interleaved_ms  # noqa: E402  (the same alternation, caches evicted alike)

CASES = [
    # (input shape, perm, what does it)
    ((8, 64, 56, 60), (0, 1, 3, 2), "the last two axes swap, rows of 56"),
    ((8, 64, 56, 56), (0, 2, 3, 1), "NCHW -> NHWC, rows of 64"),
    ((8, 56, 56, 64), (0, 3, 1, 2), "NHWC -> NCHW, rows of 3136"),
    ((8, 128, 4, 64), (0, 2, 3, 1), "rows of 128"),
    ((8, 64, 2, 2, 32, 32), (0, 1, 4, 2, 5, 3), "pixel shuffle's"),
    ((8, 64, 32, 2, 32, 2), (0, 1, 3, 5, 2, 4), "pixel unshuffle's"),
    ((8, 32, 32, 2, 32, 2), (0, 2, 4, 1, 3, 5), "a 2x2 patch convolution's patches, blocks of 2"),
    ((8, 64, 32, 2, 32, 2), (0, 1, 2, 4, 3, 5), "two middle axes swap, blocks of 2"),
    ((8, 128, 4, 64), (0, 2, 1, 3), "attention's heads, rows of 64"),
    ((8, 4, 128, 64), (0, 1, 3, 2), "attention's k transposed"),
]
#: Attention's output, [batch, heads, sequence, depth], as the CPU benchmark models have it.
HEADS = (8, 4, 128, 64)


def _options(kernels: list[str]) -> ort.SessionOptions:
    """Two intra-op threads that do not spin, as ort_dynamo's sessions; ``kernels``' library."""
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if kernels:
        so.register_custom_ops_library(_kernels.library(kernels))
    return so


def session(dims, perm, kernel: bool, bfloat16: bool = False) -> ort.InferenceSession:
    dtype = ir.DataType.BFLOAT16 if bfloat16 else ir.DataType.FLOAT
    x = ir.Value(name="x", shape=ir.Shape(list(dims)), type=ir.TensorType(dtype))
    units = []
    if kernel:
        order = ir.Value(name="perm", const_value=ir.tensor(np.array(perm, dtype=np.int64)))
        name, unit = _op_kernels.transpose_rows_kernel(bfloat16)
        node = ir.node(name, [x, order], domain=_pointwise.DOMAIN)
        initializers, opsets, units = [order], {"": 18, _pointwise.DOMAIN: 1}, [unit]
    else:
        node = ir.node("Transpose", [x], attributes={"perm": list(perm)})
        initializers, opsets = [], {"": 18}
    node.outputs[0].name, node.outputs[0].dtype = "y", dtype
    graph = ir.Graph([x], node.outputs, nodes=[node], initializers=initializers, opset_imports=opsets)
    model = ir.serde.serialize_model(ir.Model(graph, ir_version=10)).SerializeToString()
    return ort.InferenceSession(model, _options(units), providers=["CPUExecutionProvider"])


def mean_ms(sess: ort.InferenceSession, x: np.ndarray, perm) -> float:
    for _ in range(3):
        y = sess.run(None, {"x": x})[0]
    np.testing.assert_array_equal(y, x.transpose(perm))
    start = time.perf_counter()
    for _ in range(20):
        sess.run(None, {"x": x})
    return (time.perf_counter() - start) / 20 * 1e3


def mean_ms_bf16(sess: ort.InferenceSession, x: torch.Tensor, perm) -> float:
    from ort_dynamo.run import _wrap

    feed = {"x": ort.OrtValue(_wrap(x, x.data_ptr(), None))}
    for _ in range(3):
        (y,) = sess.run_with_ort_values(["y"], feed)
    assert torch.equal(torch.from_dlpack(y._ortvalue.to_dlpack()), x.permute(*perm))
    start = time.perf_counter()
    for _ in range(20):
        sess.run_with_ort_values(["y"], feed)
    return (time.perf_counter() - start) / 20 * 1e3


def bfloat16_main() -> None:
    print(f"onnxruntime {ort.__version__}; bfloat16; mean ms of 20 runs, two intra-op threads")
    for dims, perm, what in CASES:
        x = torch.randn(*dims, generator=torch.Generator().manual_seed(0))
        float32 = mean_ms(session(dims, perm, False), x.numpy(), perm)
        x = x.bfloat16()
        theirs, ours = (mean_ms_bf16(session(dims, perm, kernel, True), x, perm) for kernel in (False, True))
        chosen = _taken_by(dims, perm, _op_kernels._bfloat16_moves_slowly)
        print(f"{str(dims):22s} {str(perm):20s} ORT {theirs:6.2f} ms  kernel {ours:6.2f} ms  "
              f"ORT/kernel {theirs / ours:5.2f}  taken by: {chosen:10s} (ORT's float32: {float32:6.2f} ms; {what})")


def heads_session(inputs: int, kernel: bool) -> ort.InferenceSession:
    """``inputs`` attention outputs [8, 4, 128, 64] moved back into rows: one, a Transpose; several,
    reshaped to [8, 128, 256] and concatenated (GPT-2's q, k and v gradients). ``kernel``: as the
    pointwise stage writes them, ``MergeHeads`` or ``ConcatHeads<n>``."""
    xs = [ir.Value(name=f"x{i}", shape=ir.Shape(list(HEADS)), type=ir.TensorType(ir.DataType.FLOAT))
          for i in range(inputs)]
    opsets, initializers, units = {"": 18}, [], []
    if kernel:
        name, unit = _op_kernels.merge_heads_kernel(inputs, False)
        nodes = [ir.node(name, xs, domain=_pointwise.DOMAIN)]
        opsets[_pointwise.DOMAIN], units = 1, [unit]
    else:
        nodes = [ir.node("Transpose", [x], attributes={"perm": [0, 2, 1, 3]}) for x in xs]
        if inputs > 1:
            rows = ir.Value(name="rows", const_value=ir.tensor(np.array([8, 128, 256], dtype=np.int64)))
            initializers.append(rows)
            nodes += [ir.node("Reshape", [t.outputs[0], rows]) for t in nodes]
            nodes.append(ir.node("Concat", [r.outputs[0] for r in nodes[inputs:]], attributes={"axis": -1}))
    out = nodes[-1].outputs[0]
    out.name, out.dtype = "y", ir.DataType.FLOAT
    graph = ir.Graph(xs, [out], nodes=nodes, initializers=initializers, opset_imports=opsets)
    model = ir.serde.serialize_model(ir.Model(graph, ir_version=10)).SerializeToString()
    return ort.InferenceSession(model, _options(units), providers=["CPUExecutionProvider"])


def heads_main() -> None:
    """ORT's Transpose (and Concat) against ``MergeHeads`` / ``ConcatHeads3``, and ORT's Split with
    a bias kernel per part against ``SplitHeads3Bias``."""
    rng = np.random.default_rng(0)
    for inputs in (1, 3):
        feeds = [{f"x{i}": rng.standard_normal(HEADS, dtype=np.float32) for i in range(inputs)} for _ in range(6)]
        what = "Transpose -> MergeHeads" if inputs == 1 else "3 Transposes + Concat -> ConcatHeads3"
        _alternating((heads_session(inputs, False), heads_session(inputs, True)), feeds, f"{HEADS} {what}")
    feeds = [{"x": rng.standard_normal((8, 128, 768), dtype=np.float32),
              "b": rng.standard_normal(768, dtype=np.float32)} for _ in range(6)]
    _alternating((split_session(False), split_session(True)), feeds,
                 "(8, 128, 768) Split + 3 bias kernels -> SplitHeads3Bias")


def split_session(kernel: bool) -> ort.InferenceSession:
    """GPT-2's q, k and v from its one projection x [8, 128, 768]: a Split, each part viewed as
    [8, 128, 4, 64], plus its piece of the bias, moved into [8, 4, 128, 64], after the pointwise
    stage: ``kernel``, one ``SplitHeads3Bias``; else as before it, ORT's Split and a pointwise
    kernel per part (the bias added, heads' layout written)."""
    from unittest import mock

    x = ir.Value(name="x", shape=ir.Shape([8, 128, 768]), type=ir.TensorType(ir.DataType.FLOAT))
    bias = ir.Value(name="b", shape=ir.Shape([768]), type=ir.TensorType(ir.DataType.FLOAT))
    thirds = ir.Value(name="thirds", const_value=ir.tensor(np.array([256] * 3, dtype=np.int64)))
    split = ir.node("Split", [x], attributes={"axis": -1, "num_outputs": 3}, num_outputs=3)
    pieces = ir.node("Split", [bias, thirds], attributes={"axis": 0}, num_outputs=3)
    nodes, initializers, outputs = [split, pieces], [thirds], []
    for i in range(3):
        shapes = [ir.Value(name=f"{n}{i}", const_value=ir.tensor(np.array(d, dtype=np.int64)))
                  for n, d in (("heads", [8, 128, 4, 64]), ("bias_heads", [4, 64]))]
        initializers += shapes
        view = ir.node("Reshape", [split.outputs[i], shapes[0]])
        bias_view = ir.node("Reshape", [pieces.outputs[i], shapes[1]])
        add = ir.node("Add", [view.outputs[0], bias_view.outputs[0]])
        moved = ir.node("Transpose", [add.outputs[0]], attributes={"perm": [0, 2, 1, 3]})
        for node, dims in ((view, [8, 128, 4, 64]), (bias_view, [4, 64]), (add, [8, 128, 4, 64]),
                           (moved, [8, 4, 128, 64])):
            node.outputs[0].shape = ir.Shape(dims)
        split.outputs[i].shape = ir.Shape([8, 128, 256])
        for v in (split.outputs[i], pieces.outputs[i], view.outputs[0], bias_view.outputs[0], add.outputs[0],
                  moved.outputs[0]):
            v.dtype = ir.DataType.FLOAT
        moved.outputs[0].name = f"y{i}"
        nodes += [view, bias_view, add, moved]
        outputs.append(moved.outputs[0])
    model = ir.Model(ir.Graph([x, bias], outputs, nodes=nodes, initializers=initializers, opset_imports={"": 18}),
                     ir_version=10)
    with mock.patch.object(_op_kernels, "split_heads_as_kernels", _op_kernels.split_heads_as_kernels if kernel
                           else lambda graph: []):
        kernels = _pointwise.fuse_pointwise(model)
    return ort.InferenceSession(ir.serde.serialize_model(model).SerializeToString(), _options(kernels),
                                providers=["CPUExecutionProvider"])


#: XLNet's einsums ("ibnd,jbnd->bnij" and kin, batch 4, 4 heads of 32, 64 and 128 positions) as
#: torch decomposes them; the last is small enough to stay as it is.
UNIT_AXES = [((4, 4, 64, 1, 32), (2, 0, 1, 4, 3)), ((128, 4, 4, 32, 1), (1, 2, 4, 0, 3)),
             ((4, 4, 1, 128, 32), (0, 1, 4, 3, 2)), ((64, 4, 1, 4, 32), (0, 1, 3, 4, 2)),
             ((2, 2, 8, 1, 8), (2, 0, 1, 4, 3))]


def unit_axes_session(dims, perm, rewritten: bool) -> ort.InferenceSession:
    """One Transpose of x, as exported or after ``transposes_without_unit_axes`` (``rewritten``)."""
    x = ir.Value(name="x", shape=ir.Shape(list(dims)), type=ir.TensorType(ir.DataType.FLOAT))
    node = ir.node("Transpose", [x], attributes={"perm": list(perm)})
    node.outputs[0].name, node.outputs[0].dtype = "y", ir.DataType.FLOAT
    model = ir.Model(ir.Graph([x], node.outputs, nodes=[node], opset_imports={"": 18}), ir_version=10)
    if rewritten:
        _op_kernels.transposes_without_unit_axes(model.graph)
    return ort.InferenceSession(ir.serde.serialize_model(model).SerializeToString(), _options([]),
                                providers=["CPUExecutionProvider"])


def unit_axes_main() -> None:
    rng = np.random.default_rng(0)
    for dims, perm in UNIT_AXES:
        feeds = [{"x": rng.standard_normal(dims, dtype=np.float32)} for _ in range(6)]
        sessions = unit_axes_session(dims, perm, False), unit_axes_session(dims, perm, True)
        np.testing.assert_array_equal(sessions[0].run(None, feeds[0])[0], feeds[0]["x"].transpose(perm))
        _alternating(sessions, feeds, f"{dims} {perm}", ("ORT", "without size-1 axes"))


def _alternating(sessions, feeds, label: str, names=("before", "kernel")) -> None:
    """Checks that ``sessions`` agree, then prints the median ms of 200 calls of each, alternating,
    warm and with the caches evicted before each call (not timed), as in a training step."""
    for want, got in zip(*(s.run(None, feeds[0]) for s in sessions)):
        np.testing.assert_array_equal(got, want)
    calls = [lambda i, s=s: s.run(None, feeds[i % len(feeds)]) for s in sessions]
    for cold in (False, True):
        theirs, ours = _interleaved_ms(calls, 200, cold)
        print(f"{label:62s} {'cold' if cold else 'warm'}  {names[0]} {theirs:6.3f} ms  {names[1]} {ours:6.3f} ms  "
              f"{names[0]}/{names[1]} {theirs / ours:5.2f}")


def _taken_by(dims, perm, slow=_op_kernels._moves_elementwise) -> str:
    if _op_kernels.moves_heads(list(dims), list(perm)):
        return "MergeHeads"
    return "kernel" if slow(list(dims), list(perm)) else "ORT"


def main() -> None:
    if "--bfloat16" in sys.argv[1:]:
        return bfloat16_main()
    print(f"onnxruntime {ort.__version__}; mean ms of 20 runs, two intra-op threads")
    for dims, perm, what in CASES:
        x = np.random.default_rng(0).standard_normal(dims, dtype=np.float32)
        theirs, ours = mean_ms(session(dims, perm, False), x, perm), mean_ms(session(dims, perm, True), x, perm)
        print(f"{str(dims):22s} {str(perm):20s} ORT {theirs:6.2f} ms  kernel {ours:6.2f} ms  "
              f"ORT/kernel {theirs / ours:5.2f}  taken by: {_taken_by(dims, perm):10s} ({what})")
    print("attention's heads back into rows: median ms of 200 calls, alternating")
    heads_main()
    print("Transposes that move an axis of size 1 (torch's einsum), as exported and after the rewrite")
    unit_axes_main()


if __name__ == "__main__":
    main()
