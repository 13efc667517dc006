"""Peak memory of one attention layer's training step on CPU: eager, ort (ort_dynamo's attention
kernels) and ort with attention written out (``cpu_attention_kernel=False``), each in a fresh
process, at a few sequence lengths. Written out, a step makes [batch, heads, S, S] tensors; the
kernels keep a head's scores in cache.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/attention_memory.py
    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/attention_memory.py --lengths 512,2048 --causal

Printed: the peak of live bytes (allocated and not yet freed; memory_phases.py's counters, ORT's
arena off) over those before the measured steps, after two warm-up steps (compiles, kernels
built), in MB.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

VARIANTS = {"eager": None, "ort": {}, "ort_written_attention": {"cpu_attention_kernel": False}}


def _child(variant: str, length: int, causal: bool, batch: int, heads: int, head_size: int) -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from memory_phases import _live_bytes_counters

    live = _live_bytes_counters()  # runs this process again under the counters' library

    import torch
    import torch.nn.functional as F

    import ort_dynamo

    torch.manual_seed(0)

    def attention(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    options = VARIANTS[variant]
    fn = attention if options is None else torch.compile(attention, backend="ort", options=options)
    qkv = [torch.randn(batch, heads, length, head_size, requires_grad=True) for _ in range(3)]
    for _ in range(2):
        fn(*qkv).sum().backward()
        ort_dynamo.wait_for_kernels()
    before = live.now()
    live.reset_peak()
    for _ in range(3):
        fn(*qkv).sum().backward()
    print(f"{live.peak() - before:.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="128,512,1024")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-size", type=int, default=64)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return _child(args.child[0], int(args.child[1]), args.causal, args.batch, args.heads, args.head_size)
    print(f"one attention layer, forward and backward: batch {args.batch}, {args.heads} heads of {args.head_size}, "
          f"{'causal' if args.causal else 'not causal'}; peak live MB over the steps' start")
    for length in (int(n) for n in args.lengths.split(",")):
        peaks = {}
        for variant in VARIANTS:
            command = [sys.executable, os.path.abspath(__file__), "--child", variant, str(length),
                       "--batch", str(args.batch), "--heads", str(args.heads), "--head-size", str(args.head_size),
                       *(["--causal"] if args.causal else [])]
            done = subprocess.run(command, capture_output=True, text=True, check=True)
            peaks[variant] = float(done.stdout.split()[-1])
        print(f"length {length:5d}: " + "  ".join(f"{name} {mb:7.1f}" for name, mb in peaks.items()))


if __name__ == "__main__":
    main()
