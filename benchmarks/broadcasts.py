"""ORT's CPU elementwise ops with a one-element constant operand, before and after
``_op_kernels.one_element_operands_at_full_rank``, one op per session, calls interleaved.

    .venv/bin/python benchmarks/broadcasts.py

A scalar over a result whose last axis has size 1 (a pooler's [N, C, 1, 1], a norm's statistics
[8, 128, 1]) goes through ORT's broadcasting one element at a time; given the result's rank
([1, 1, 1, 1]) it does not. For each case: median µs of the op with the constant as written
(a scalar ``[]``) and as the rewrite leaves it, their ratio, and whether the rewrite changed
it (it does only where the result's last axis is 1; elsewhere a scalar is ORT's fast case, and
the script shows what a changed operand would cost there too, by giving it the result's rank
by hand). Every pair of results is checked equal, but Pow by 2, which ORT's element-by-element
path computes with powf and its other paths as x * x: there the rewritten op must give torch's
``x.pow(2)`` exactly, and the script says whether the scalar one does.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ort_dynamo import _op_kernels  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gemm import _interleaved_ms  # noqa: E402  (the same alternation)

CASES = [
    # (op, result shape, what has it)
    ("Mul", (8, 320, 1, 1), "a pooler's result by a scalar"),
    ("Pow", (8, 320, 1, 1), "its square"),
    ("Where", (8, 320, 1, 1), "a mask over it, two scalars"),
    ("Mul", (8, 128, 1), "a norm's statistics"),
    ("Pow", (8, 128, 1), "a norm's statistics, a power"),
    ("Where", (1024, 1), "the loss's mask per token"),
    ("Mul", (8, 320), "no axis of size 1 last"),
    ("Where", (1024, 64), "a longer last axis"),
    ("Mul", (8, 128, 1024), "a longer last axis, large"),
    ("Pow", (8, 128, 1024), "the same, a power"),
]


def _model(op: str, shape: tuple, rank: int) -> ir.Model:
    """``op`` on an input of ``shape`` and one-element constants of ``rank`` axes."""
    x = ir.Value(name="x", shape=ir.Shape(list(shape)), type=ir.TensorType(
        ir.DataType.BOOL if op == "Where" else ir.DataType.FLOAT))
    values = [2.0, 0.5] if op == "Where" else [2.0]
    constants = [ir.Value(name=f"c{i}", shape=ir.Shape([1] * rank), type=ir.TensorType(ir.DataType.FLOAT),
                          const_value=ir.tensor(np.full([1] * rank, v, dtype=np.float32)))
                 for i, v in enumerate(values)]
    node = ir.node(op, [x, *constants])
    node.outputs[0].name, node.outputs[0].dtype = "y", ir.DataType.FLOAT
    node.outputs[0].shape = ir.Shape(list(shape))
    graph = ir.Graph([x], node.outputs, nodes=[node], initializers=constants, opset_imports={"": 18})
    return ir.Model(graph, ir_version=10)


def _session(model: ir.Model) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = torch.get_num_threads()
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(ir.serde.serialize_model(model).SerializeToString(), so,
                                providers=["CPUExecutionProvider"])


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args()
    print(f"threads: {torch.get_num_threads()}, onnxruntime {ort.__version__}; median µs of 200 interleaved calls")
    rng = np.random.default_rng(0)
    for op, shape, what in CASES:
        rewritten = _model(op, shape, 0)
        changed = _op_kernels.one_element_operands_at_full_rank(rewritten.graph) > 0
        scalar, full = _session(_model(op, shape, 0)), _session(rewritten if changed else _model(op, shape, len(shape)))
        x = rng.random(shape) > 0.5 if op == "Where" else rng.standard_normal(shape).astype(np.float32)
        want, got = (s.run(["y"], {"x": x})[0] for s in (scalar, full))
        note = ""
        if op == "Pow":  # by 2 (``_model``'s constant)
            eager = torch.from_numpy(x).pow(2).numpy()
            np.testing.assert_array_equal(got, eager)
            note = f", scalar {'=' if np.array_equal(want, eager) else '!'}= torch's x.pow(2)"
        else:
            np.testing.assert_array_equal(got, want)
        a, b = _interleaved_ms([lambda i: scalar.run(["y"], {"x": x}), lambda i: full.run(["y"], {"x": x})],
                               200, False)
        print(f"{op:6s} {str(shape):17s} scalar {a * 1e3:7.1f} µs  result's rank {b * 1e3:7.1f} µs  "
              f"ratio {b / a:.2f}  {'changed by the rewrite' if changed else 'left as it is'}{note}  ({what})")


if __name__ == "__main__":
    main()
