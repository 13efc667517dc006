"""GPU memory each ORT CUDA session holds beyond PyTorch's pool (GPU machine).

    python3 benchmarks/session_memory.py --sessions 16

Compiles ``--sessions`` small graphs, each with a matrix product (each its own ORT session on
the CUDA provider), runs each once on the main thread and once on a second thread (autograd
runs backward graphs on a thread of its own, and ORT's CUDA provider keeps per-thread
handles), and prints the device memory in use beyond PyTorch's pool after each count. GPT-2
124M trains with about 59 sessions, and ort's peak was 2.6 GB over eager's on an H100
(docs/performance-log.md); if each session holds tens of MB of CUDA library handles and
workspaces, fewer sessions is the way to less memory.

The product is there because cuBLAS makes a handle's workspace at its first product: its
default size (up to 32 MiB per handle on recent GPUs) is what ``CUBLAS_WORKSPACE_CONFIG`` sets
(":4096:1" is 4 MiB), so running this once with that variable and once without says how much
of a session's memory is cuBLAS's workspace (``tools/gpu_check.sh`` steps ``session-memory``
and ``session-memory-cublas-4mb``). PyTorch reads the same variable for its own workspace.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import threading

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_step  # noqa: E402

import ort_dynamo  # noqa: E402


def beyond_pytorch_mb() -> float:
    return train_step._device_used_mb() - torch.cuda.memory_reserved() / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--size", type=int, default=1 << 20, help="elements of each graph's input (a square matrix)")
    args = parser.parse_args()
    side = math.isqrt(args.size)
    x = torch.randn(side, side, device="cuda")
    x @ x  # PyTorch's own cuBLAS handle and workspace, before the baseline
    torch.cuda.synchronize()
    base = beyond_pytorch_mb()
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"CUBLAS_WORKSPACE_CONFIG={os.environ.get('CUBLAS_WORKSPACE_CONFIG', '(unset)')}; beyond PyTorch's pool "
          f"before any session: {base:.0f} MB")
    last = base
    for k in range(1, args.sessions + 1):
        # Its own code object and constant: one lambda with k as an argument became one graph
        # with a symbolic k after Dynamo's first recompile, so 16 "sessions" were 2 (H200 run).
        fn = torch.compile(eval(f"lambda t: ((t @ t) * {k + 1}).sin().sum()"), backend="ort",
                           options={"pointwise_kernels": False})
        fn(x)
        worker = threading.Thread(target=fn, args=(x,))
        worker.start()
        worker.join()
        now = beyond_pytorch_mb()
        if k & (k - 1) == 0 or k == args.sessions:
            print(f"{k:3d} sessions: {now - base:7.0f} MB beyond PyTorch's pool, the last one {now - last:5.0f} MB")
        last = now
    sessions = ort_dynamo.report().sessions
    print(f"{sessions} sessions in the report; {(last - base) / max(sessions, 1):.1f} MB "
          "per session on average (the first also pays the process's one-time CUDA costs)")
    if sessions < args.sessions:
        sys.exit(f"only {sessions} sessions were made for {args.sessions} graphs: the figures above are not per session")


if __name__ == "__main__":
    main()
