#!/usr/bin/env python3
"""Optimizer step time: ort_dynamo FusedAdam vs torch.optim.AdamW (foreach, fused, for-loop).

One process, the optimizers interleaved step by step (so machine noise hits all alike), each
on its own copy of a model with ~100 parameter tensors and fixed gradients; the median of
``--steps`` timed steps after ``--warmup``.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/optimizer_step.py [--device cuda] [--width 256]

OMP_WAIT_POLICY=PASSIVE keeps idle PyTorch OpenMP threads from spinning against ORT's threads
(see docs/optimizers.md, Performance).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

import ort_dynamo
from ort_dynamo.optim import AdamWMode, FusedAdam


def build_model(width: int, blocks: int) -> torch.nn.Module:
    layers = []
    for _ in range(blocks):  # 4 tensors per block: weight, bias, norm weight, norm bias
        layers += [torch.nn.Linear(width, width), torch.nn.LayerNorm(width)]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 8))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=24)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    device = torch.device(args.device)
    base = build_model(args.width, args.blocks).to(device)
    for p in base.parameters():
        p.grad = torch.randn_like(p) * 1e-2
    kwargs = dict(lr=1e-3, eps=1e-8, weight_decay=0.01)
    makers = {
        "ort_dynamo FusedAdam": lambda ps: FusedAdam(ps, adam_w_mode=AdamWMode.ADAMW_TORCH, **kwargs),
        "torch AdamW foreach": lambda ps: torch.optim.AdamW(ps, foreach=True, **kwargs),
        "torch AdamW fused": lambda ps: torch.optim.AdamW(ps, fused=True, **kwargs),
        "torch AdamW for-loop": lambda ps: torch.optim.AdamW(ps, foreach=False, **kwargs),
    }
    runs = {}
    for name, make in makers.items():
        model = copy.deepcopy(base)
        for p, q in zip(model.parameters(), base.parameters()):
            p.grad = q.grad.clone()
        runs[name] = make(list(model.parameters()))
    n_tensors = sum(1 for _ in base.parameters())
    n_elems = sum(p.numel() for p in base.parameters())
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            ort_dynamo.wait_for_kernels()  # CPU: FusedAdam's kernel, compiled in the background
        for name, opt in runs.items():
            sync()
            start = time.perf_counter()
            opt.step()
            sync()
            if i >= args.warmup:
                times[name].append(time.perf_counter() - start)
    fused = runs["ort_dynamo FusedAdam"]
    print(f"device={device} torch={torch.__version__} threads={torch.get_num_threads()} "
          f"tensors={n_tensors} elements={n_elems:,} steps={args.steps} (median after {args.warmup} warm-up)")
    print(f"FusedAdam: {fused.ort_runs} ORT runs, {fused.graphs_built} graph(s) built")
    base_ms = statistics.median(times["ort_dynamo FusedAdam"]) * 1e3
    print(f"{'optimizer':<24}{'ms/step':>10}{'vs FusedAdam':>14}")
    for name, ts in times.items():
        ms = statistics.median(ts) * 1e3
        print(f"{name:<24}{ms:>10.3f}{ms / base_ms:>13.2f}x")


if __name__ == "__main__":
    main()
