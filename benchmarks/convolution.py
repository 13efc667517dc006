"""ort_dynamo's convolution kernels against ORT's ops and PyTorch's (oneDNN), one pass of a
layer at a time, the calls interleaved in one process, same threads.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/convolution.py [--cold] [--passes P] [case ...]

Per case of benchmarks/layer_ops.py's convolutions, three passes in the forms ort_dynamo's
graphs have them: the forward Conv and the input gradient (a ConvTranspose), both csrc/conv.h's
where the rewrite takes them, and the weight gradient (csrc/conv_weight_grad.h).
ORT's column is the op the rewrite replaces (im2col or col2im and MLAS). ``--cold``: the caches
evicted before each call (untimed), as in a training step."""

from __future__ import annotations

import argparse
import math
import statistics
import sys

import numpy as np
import onnx
import onnxruntime as ort
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from gemm import _interleaved_ms, _ort_values  # noqa: E402
from train_step import _steady_malloc  # noqa: E402

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
    ("shortcut_conv", (8, 64, 56, 56), (128, 64, 1, 1), 2, 0, 1),
    ("dilated", (8, 64, 32, 32), (64, 64, 3, 3), 1, 2, 2),
]


def _graph(kind: str, x_shape, w_shape, stride, padding, dilation):
    """(ONNX graph, its two input names and shapes, output shape) of one pass of a layer, in the
    form ort_dynamo's graphs have it: "forward" Conv(x, w); "input grad" ConvTranspose(gy, w);
    "weight grad" Conv(Transpose(x), Transpose(gy)) with stride and dilation
    exchanged, its result swapped back and cut to the window (decompositions._conv_weight_grad)."""
    spatial = len(x_shape) - 2
    out = [(n + 2 * padding - dilation * (k - 1) - 1) // stride + 1 for n, k in zip(x_shape[2:], w_shape[2:])]
    gy_shape = [x_shape[0], w_shape[0], *out]
    geometry = dict(pads=[padding] * 2 * spatial)
    swap = [1, 0, *range(2, spatial + 2)]
    if kind == "forward":
        inputs, nodes = [("x", x_shape), ("w", w_shape)], [
            helper.make_node("Conv", ["x", "w"], ["y"], strides=[stride] * spatial, dilations=[dilation] * spatial,
                             **geometry)]
    elif kind == "input grad":
        extra = [n - ((o - 1) * stride - 2 * padding + dilation * (k - 1) + 1)
                 for n, o, k in zip(x_shape[2:], out, w_shape[2:])]  # rows no window reaches
        inputs, nodes = [("gy", gy_shape), ("w", w_shape)], [
            helper.make_node("ConvTranspose", ["gy", "w"], ["y"], strides=[stride] * spatial,
                             dilations=[dilation] * spatial, output_padding=extra, **geometry)]
    else:
        inputs, nodes = [("x", x_shape), ("gy", gy_shape)], [
            helper.make_node("Transpose", ["x"], ["xt"], perm=swap),
            helper.make_node("Transpose", ["gy"], ["gyt"], perm=swap),
            helper.make_node("Conv", ["xt", "gyt"], ["wt"], strides=[dilation] * spatial,
                             dilations=[stride] * spatial, **geometry),
            helper.make_node("Transpose", ["wt"], ["wfull"], perm=swap),
            # the taps past the window (a stride-2 layer over an even size has them) cut
            helper.make_node("Slice", ["wfull", "zeros", "window", "spatial"], ["y"])]
        initializers = [helper.make_tensor(name, TensorProto.INT64, [spatial], values) for name, values in
                        (("zeros", [0] * spatial), ("window", w_shape[2:]), ("spatial", range(2, 2 + spatial)))]
    graph = helper.make_graph(nodes, "conv", [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape)
                                              for n, shape in inputs],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              initializer=initializers if kind == "weight grad" else None)
    return graph, inputs


def _session(graph, ours: bool) -> ort.InferenceSession:
    import onnx_ir as ir

    from ort_dynamo import _kernels, _op_kernels

    proto = onnx.shape_inference.infer_shapes(
        helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 18)]))
    so = ort.SessionOptions()
    so.intra_op_num_threads = torch.get_num_threads()
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if ours:
        model = ir.serde.deserialize_model(proto)
        units = _op_kernels.conv_weight_grads_as_kernels(model.graph, lambda: True) \
            + _op_kernels.convs_as_kernels(model.graph, lambda: True)
        assert units, "the rewrite took nothing"
        for name in [n for n, value in model.graph.initializers.items() if not value.uses()]:
            del model.graph.initializers[name]  # a Slice's bounds the kernel took in
        model.opset_imports[_op_kernels.DOMAIN] = 1
        so.register_custom_ops_library(_kernels.library(units))
        proto = ir.serde.serialize_model(model)
    return ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _torch_pass(kind: str, stride, padding, dilation, x_shape, w_shape):
    """PyTorch's computation of the pass, on (a, b) as the graph's inputs."""
    mask = {"input grad": [True, False, False], "weight grad": [False, True, False]}.get(kind)
    conv = {3: F.conv1d, 4: F.conv2d, 5: F.conv3d}[len(w_shape)]
    if mask is None:
        return lambda x, w: conv(x, w, None, stride, padding, dilation)
    spatial = len(w_shape) - 2

    unused = {torch.float32: (torch.empty(x_shape), torch.empty(w_shape)),  # only their shapes are read
              torch.float64: (torch.empty(x_shape, dtype=torch.float64), torch.empty(w_shape, dtype=torch.float64))}

    def backward(a, b):
        gy, x, w = (a, unused[a.dtype][0], b) if kind == "input grad" else (b, a, unused[a.dtype][1])
        result = torch.ops.aten.convolution_backward(gy, x, w, None, [stride] * spatial, [padding] * spatial,
                                                     [dilation] * spatial, False, [0] * spatial, 1, mask)
        return result[0] if kind == "input grad" else result[1]
    return backward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--cold", action="store_true", help="caches evicted before each call")
    parser.add_argument("--passes", default="forward,input grad,weight grad",
                        help="comma-separated: forward, input grad, weight grad")
    parser.add_argument("cases", nargs="*", help="names of CASES (default: all)")
    args = parser.parse_args()
    from ort_dynamo import _kernels

    if not (_kernels.available() and _kernels.float32_products()):
        raise SystemExit("ort_dynamo's convolutions are built with its float32 products: no C compiler targeting "
                         "AVX-512 here")
    print(f"torch {torch.__version__}, onnxruntime {ort.__version__}, {torch.get_num_threads()} threads; "
          f"median ms of {args.repeats} interleaved calls{', cold caches' if args.cold else ''}")
    torch.manual_seed(0)
    _steady_malloc()  # as layer_ops.py and train_step.py: large blocks kept after free, for every side
    copies = 4
    ratios, torch_ratios = [], []
    passes = args.passes.split(",")
    for name, x_shape, w_shape, stride, padding, dilation in CASES:
        if args.cases and name not in args.cases:
            continue
        for kind in passes:
            if kind != "forward" and math.prod(w_shape[2:]) == 1:
                continue
            graph, inputs = _graph(kind, x_shape, w_shape, stride, padding, dilation)
            try:
                ours = _session(graph, True)
            except AssertionError:
                print(f"{name:16s} {kind:12s} not taken by the rewrite")
                continue
            theirs = _session(graph, False)
            a = [torch.randn(*inputs[0][1]) for _ in range(copies)]
            b = torch.randn(*inputs[1][1])
            feeds = [dict(zip([n for n, _ in inputs], _ort_values([t, b]))) for t in a]
            reference = _torch_pass(kind, stride, padding, dilation, x_shape, w_shape)
            got = torch.from_numpy(ours.run_with_ort_values(["y"], feeds[0])[0].numpy())
            want = reference(a[0].double(), b.double())
            error = float((got - want).abs().max() / want.abs().max())
            with torch.no_grad():
                ours_ms, ort_ms, torch_ms = _interleaved_ms(
                    [lambda i: ours.run_with_ort_values(["y"], feeds[i % copies]),
                     lambda i: theirs.run_with_ort_values(["y"], feeds[i % copies]),
                     lambda i: reference(a[i % copies], b)], args.repeats, args.cold)
            out = [(n + 2 * padding - dilation * (k - 1) - 1) // stride + 1 for n, k in zip(x_shape[2:], w_shape[2:])]
            flops = 2 * x_shape[0] * math.prod(out) * math.prod(w_shape)
            ratios.append(ours_ms / ort_ms)
            torch_ratios.append(ours_ms / torch_ms)
            print(f"{name:16s} {kind:12s} ours {ours_ms:6.2f} ms ({flops / ours_ms / 1e6:4.0f} GF/s)  "
                  f"ORT {ort_ms:6.2f}  torch {torch_ms:6.2f}  ours/ORT {ours_ms / ort_ms:4.2f}  "
                  f"ours/torch {ours_ms / torch_ms:4.2f}  error {error:.1e}", flush=True)
    print(f"geometric mean ours/ORT {statistics.geometric_mean(ratios):.2f}, "
          f"ours/torch {statistics.geometric_mean(torch_ratios):.2f}")


if __name__ == "__main__":
    main()
