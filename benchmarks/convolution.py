"""ort_dynamo's convolution (csrc/conv.h: one float32 product whose columns it reads from the
input) against ORT's Conv (im2col and MLAS) and PyTorch's (oneDNN), one op at a time, the
calls interleaved in one process, same threads.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/convolution.py [--cold] [--repeats N]

The shapes are benchmarks/layer_ops.py's convolution cases: each layer's forward Conv and, for
the stride-1 ones, its input gradient as decompositions.py writes it where this kernel exists
(a Conv of the output gradient by the flipped, swapped weight). ``--cold``: the caches evicted
before each call (untimed), as in a training step.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import numpy as np
import onnxruntime as ort
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from gemm import _interleaved_ms, _ort_values  # noqa: E402

# (case, input shape, weight shape, stride, padding, dilation)
CASES = [
    ("conv3x3", (8, 64, 32, 32), (64, 64, 3, 3), 1, 1, 1),
    ("conv3x3_64", (4, 64, 64, 64), (64, 64, 3, 3), 1, 1, 1),
    ("conv3x3_deep", (8, 256, 14, 14), (256, 256, 3, 3), 1, 1, 1),
    ("conv3x3_s2", (8, 64, 32, 32), (128, 64, 3, 3), 2, 1, 1),
    ("conv_4x4_s2", (8, 64, 32, 32), (128, 64, 4, 4), 2, 1, 1),
    ("conv1d_k3", (8, 256, 256), (256, 256, 3), 1, 1, 1),
    ("stem_conv", (8, 3, 112, 112), (64, 3, 7, 7), 2, 3, 1),
    ("pointwise_conv", (8, 64, 28, 28), (192, 64, 1, 1), 1, 0, 1),
    ("pointwise_conv input grad", (8, 192, 28, 28), (64, 192, 1, 1), 1, 0, 1),
    ("shortcut_conv", (8, 64, 56, 56), (128, 64, 1, 1), 2, 0, 1),
    ("dilated", (8, 64, 32, 32), (64, 64, 3, 3), 1, 2, 2),
]


def _model(x_shape, w_shape, stride, padding, dilation, ours: bool) -> ort.InferenceSession:
    import onnx_ir as ir

    from ort_dynamo import _kernels, _op_kernels

    spatial = len(x_shape) - 2
    node = helper.make_node("Conv", ["x", "w"], ["y"], strides=[stride] * spatial, pads=[padding] * 2 * spatial,
                            dilations=[dilation] * spatial)
    graph = helper.make_graph([node], "conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape),
                                               helper.make_tensor_value_info("w", TensorProto.FLOAT, w_shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    proto = helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 18)])
    so = ort.SessionOptions()
    so.intra_op_num_threads = torch.get_num_threads()
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if ours:
        model = ir.serde.deserialize_model(proto)
        units = _op_kernels.convs_as_kernels(model.graph, lambda: True)
        assert units, "the rewrite did not take the Conv"
        model.opset_imports[_op_kernels.DOMAIN] = 1
        so.register_custom_ops_library(_kernels.library(units))
        proto = ir.serde.serialize_model(model)
    return ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--cold", action="store_true", help="caches evicted before each call")
    args = parser.parse_args()
    from ort_dynamo import _kernels

    if not (_kernels.available() and _kernels.bfloat16_products()):
        raise SystemExit("ort_dynamo's convolution is built with its float32 products: no C compiler targeting "
                         "AVX512-BF16 here")
    print(f"torch {torch.__version__}, onnxruntime {ort.__version__}, {torch.get_num_threads()} threads; "
          f"median ms of {args.repeats} interleaved calls{', cold caches' if args.cold else ''}")
    torch.manual_seed(0)
    copies = 4
    ratios, torch_ratios = [], []
    cases = []
    for name, x_shape, w_shape, stride, padding, dilation in CASES:
        cases.append((name, x_shape, w_shape, stride, padding, dilation))
        if stride == 1 and "grad" not in name and w_shape[2] > 1:  # its input gradient, as a Conv
            out = [n + 2 * padding - dilation * (k - 1) for n, k in zip(x_shape[2:], w_shape[2:])]
            cases.append((name + " input grad", (x_shape[0], w_shape[0], *out), (w_shape[1], w_shape[0], *w_shape[2:]),
                          1, dilation * (w_shape[2] - 1) - padding, dilation))
    conv = {3: F.conv1d, 4: F.conv2d, 5: F.conv3d}
    for name, x_shape, w_shape, stride, padding, dilation in cases:
        xs = [torch.randn(*x_shape) for _ in range(copies)]
        w = torch.randn(*w_shape)
        ours, theirs = (_model(x_shape, w_shape, stride, padding, dilation, flag) for flag in (True, False))
        feeds = [dict(zip("xw", _ort_values([x, w]))) for x in xs]
        got = torch.from_numpy(ours.run_with_ort_values(["y"], feeds[0])[0].numpy())
        want = conv[len(x_shape)](xs[0].double(), w.double(), None, stride, padding, dilation)
        error = float((got - want).abs().max() / want.abs().max())
        with torch.no_grad():
            ours_ms, ort_ms, torch_ms = _interleaved_ms(
                [lambda i: ours.run_with_ort_values(["y"], feeds[i % copies]),
                 lambda i: theirs.run_with_ort_values(["y"], feeds[i % copies]),
                 lambda i: conv[len(x_shape)](xs[i % copies], w, None, stride, padding, dilation)],
                args.repeats, args.cold)
        flops = 2 * want.numel() * np.prod(w_shape[1:])
        ratios.append(ours_ms / ort_ms)
        torch_ratios.append(ours_ms / torch_ms)
        print(f"{name:28s} x {str(x_shape):18s} w {str(w_shape):18s} ours {ours_ms:6.2f} ms "
              f"({flops / ours_ms / 1e6:4.0f} GF/s)  ORT {ort_ms:6.2f}  torch {torch_ms:6.2f}  "
              f"ours/ORT {ours_ms / ort_ms:4.2f}  ours/torch {ours_ms / torch_ms:4.2f}  error {error:.1e}", flush=True)
    print(f"geometric mean ours/ORT {statistics.geometric_mean(ratios):.2f}, "
          f"ours/torch {statistics.geometric_mean(torch_ratios):.2f}")


if __name__ == "__main__":
    main()
