"""ORT's GEMM (MLAS, via FusedMatMul with its transposes) against PyTorch's (torch.mm) on the
shapes of the benchmark models' training steps, one process, same threads.

    .venv/bin/python benchmarks/gemm.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import onnxruntime as ort
import torch
from onnx import TensorProto, helper

# (M, K, N) of the CPU benchmark models: tokens 1024, hidden 256, MLP 1024, GPT-2's QKV 768.
SHAPES = [(1024, 256, 256), (1024, 256, 1024), (1024, 1024, 256), (256, 1024, 256),
          (1024, 256, 768), (256, 1024, 768)]


def _session(a_shape, b_shape, trans_a: int, trans_b: int) -> ort.InferenceSession:
    m = a_shape[1] if trans_a else a_shape[0]
    n = b_shape[0] if trans_b else b_shape[1]
    node = helper.make_node("FusedMatMul", ["a", "b"], ["y"], domain="com.microsoft",
                            transA=trans_a, transB=trans_b, alpha=1.0)
    graph = helper.make_graph([node], "gemm", [helper.make_tensor_value_info("a", TensorProto.FLOAT, a_shape),
                                                helper.make_tensor_value_info("b", TensorProto.FLOAT, b_shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [m, n])])
    model = helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 18),
                                                                    helper.make_opsetid("com.microsoft", 1)])
    so = ort.SessionOptions()
    so.intra_op_num_threads = torch.get_num_threads()
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _median_ms(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=40)
    args = parser.parse_args()
    print(f"threads: {torch.get_num_threads()}, onnxruntime {ort.__version__}, torch {torch.__version__}")
    ratios = []
    for m, k, n in SHAPES:
        for trans_a, trans_b in ((0, 0), (0, 1), (1, 0)):
            a_shape, b_shape = ([k, m] if trans_a else [m, k]), ([n, k] if trans_b else [k, n])
            a, b = np.random.randn(*a_shape).astype(np.float32), np.random.randn(*b_shape).astype(np.float32)
            session = _session(a_shape, b_shape, trans_a, trans_b)
            ort_ms = _median_ms(lambda: session.run(None, {"a": a, "b": b}), args.repeats)
            ta, tb = torch.from_numpy(a), torch.from_numpy(b)
            ta, tb = (ta.t() if trans_a else ta), (tb.t() if trans_b else tb)
            torch_ms = _median_ms(lambda: torch.mm(ta, tb), args.repeats)
            ratios.append(ort_ms / torch_ms)
            print(f"M {m:5d} K {k:5d} N {n:5d} transA {trans_a} transB {trans_b}: "
                  f"ort {ort_ms:6.2f} ms  torch {torch_ms:6.2f} ms  ort/torch {ort_ms / torch_ms:.2f}")
    print(f"geometric mean ort/torch: {statistics.geometric_mean(ratios):.2f}")


if __name__ == "__main__":
    main()
