"""Whether the host runs ahead of the GPU across ORT runs, as it does in eager (GPU machine).

    python3 benchmarks/host_ahead.py

A chain of 20 float32 4096x4096 products with tanh takes the GPU tens of milliseconds. Right
after a call returns, the work should still be queued on PyTorch's stream, and the call should
have taken the host far less than that. Checked for eager, for ort_dynamo, and for plain ORT
sessions made with ort_dynamo's settings and one setting changed each.

On an H200 (2026-11-26) every plain session given PyTorch's legacy default stream as PyTorch
names it (handle 0) returned in under a millisecond with PyTorch's stream idle: ORT ran on a
stream of its own ("stream handle 0" below). Given cudaStreamLegacy (handle 1), which is how
ort_dynamo names that stream now (``run.compute_stream``), ORT runs on it, ordered with
PyTorch's work (H100, 2026-11-26: host ahead, and a result read from a still-queued input
right). "side stream" checks that a non-zero handle of another stream is honoured.
"""

from __future__ import annotations

import time

import numpy as np
import onnx
import onnx.helper as oh
import torch

import ort_dynamo
from ort_dynamo import run as run_stage
from ort_dynamo.options import OrtOptions

C = run_stage.C
SIZE, LAYERS = 4096, 20


def heavy(x):
    for _ in range(LAYERS):
        x = torch.tanh(x @ x)
    return x


def heavy_model() -> bytes:
    nodes, name = [], "x"
    for i in range(LAYERS):
        nodes += [oh.make_node("MatMul", [name, name], [f"m{i}"]), oh.make_node("Tanh", [f"m{i}"], [f"t{i}"])]
        name = f"t{i}"
    graph = oh.make_graph(nodes, "heavy", [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [SIZE, SIZE])],
                          [oh.make_tensor_value_info(name, onnx.TensorProto.FLOAT, [SIZE, SIZE])])
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)], ir_version=9).SerializeToString()


def ahead(call, x, calls: int = 4, stream=None) -> tuple[list[bool], float]:
    """Whether ``stream`` (PyTorch's current one by default) still had work right after each
    call (after a synchronized start), and the median host milliseconds a call took."""
    pending, host = [], []
    stream = stream or torch.cuda.current_stream()
    for _ in range(calls):
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.cuda.stream(stream):
            call(x)
        host.append((time.perf_counter() - start) * 1e3)
        pending.append(not stream.query())
    torch.cuda.synchronize()
    return pending, sorted(host)[len(host) // 2]


def plain_session(variant: str, stream=None):
    """A session made as ort_dynamo makes one, with ``variant`` changed, on PyTorch's default
    stream or ``stream``; returns a call."""
    device = torch.device("cuda")
    options = OrtOptions()
    so = run_stage.session_options(options, "cuda")
    providers = run_stage.providers_for(device, options)
    cuda = dict(providers[0][1])
    cuda["user_compute_stream"] = str(stream.cuda_stream if stream is not None else run_stage.compute_stream(device))
    run_options = run_stage.run_options(device)
    if variant == "no memory pattern":
        so.enable_mem_pattern = False
    elif variant == "no user stream":
        cuda.pop("user_compute_stream")
        cuda["has_user_compute_stream"] = "0"
    elif variant == "synchronizing run options":
        run_options = C.RunOptions()
    elif variant == "no env allocators":
        so.add_session_config_entry("session.use_env_allocators", "0")
    elif variant == "stream handle 0":
        # PyTorch's name for its default stream, which ORT takes for "none given".
        cuda["user_compute_stream"] = "0"
    sess = run_stage.ort.InferenceSession(heavy_model(), so, providers=[("CUDAExecutionProvider", cuda),
                                                                        "CPUExecutionProvider"])
    where = run_stage.ort_device(device)
    out_name = sess.get_outputs()[0].name

    def call(x):
        inputs = C.OrtValueVector()
        inputs.push_back_batch([x], [x.data_ptr()], [run_stage._NUMPY_DTYPES[x.dtype]], [x.shape], [where])
        outputs = C.OrtValueVector()
        sess._sess.run_with_ortvaluevector(run_options, ["x"], inputs, [out_name], outputs, [where])
        return outputs.to_dlpacks(torch._C._from_dlpack)[0]

    if variant == "io binding":
        binding = sess.io_binding()

        def call(x):  # noqa: F811 - the IOBinding path instead
            binding.bind_input("x", "cuda", 0, np.float32, [SIZE, SIZE], x.data_ptr())
            binding.bind_output(out_name, "cuda")
            sess._sess.run_with_iobinding(binding._iobinding, run_options)
    return call


def main() -> None:
    x = torch.randn(SIZE, SIZE, device="cuda") / 64
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, onnxruntime {run_stage.ort.__version__}")
    rows = [("eager", heavy), ("ort_dynamo", torch.compile(heavy, backend="ort"))]
    rows += [(f"plain session: {v}", plain_session(v)) for v in
             ("as ort_dynamo", "no memory pattern", "no user stream", "synchronizing run options",
              "no env allocators", "io binding", "stream handle 0")]
    side = torch.cuda.Stream()
    rows.append(("plain session: side stream", plain_session("side stream", side)))
    for name, call in rows:
        try:
            stream = side if name.endswith("side stream") else None
            call(x)  # compile, make sessions
            pending, host_ms = ahead(call, x, stream=stream)
            print(f"{name:40s} host ran ahead after each call: {pending}  host {host_ms:6.2f} ms per call")
        except Exception as exc:  # noqa: BLE001 - a diagnostic: report and go on
            print(f"{name:40s} failed: {type(exc).__name__}: {str(exc)[:200]}")
    plain = plain_session("as ort_dynamo")
    try:  # ordered with PyTorch's work? its input is still being computed when the call is made
        torch.cuda.synchronize()
        got = plain(heavy(x))
        torch.cuda.synchronize()
        same = torch.allclose(got, heavy(heavy(x)), rtol=1e-3, atol=1e-3)
        print(f"{'plain session, input still queued':40s} result as eager's: {same}")
    except Exception as exc:  # noqa: BLE001
        print(f"plain session with a queued input failed: {type(exc).__name__}: {str(exc)[:200]}")
    print(ort_dynamo.report())


if __name__ == "__main__":
    main()
