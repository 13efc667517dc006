"""Where a training step's memory sits: RSS after forward, backward and optimizer, per step,
for one backend in a fresh process (the numbers in docs/performance.md, "where ort's extra
megabytes sit").

    .venv/bin/python benchmarks/memory_phases.py --model bert --backend eager
    .venv/bin/python benchmarks/memory_phases.py --model bert --backend ort

Megabytes over the RSS before the first step (as train_step.py --memory counts them), after a
tiny warm-up model so one-time start-up is not counted.

    # the shared arena with other settings (OrtArenaCfg keys; -1: ORT's default)
    .venv/bin/python benchmarks/memory_phases.py --model llama --arena initial_chunk_size_bytes=-1
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from train_step import _peak_rss_mb, _reset_peak_rss, _rss_mb, build, compiled_copy, warm_backend  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="bert", choices=["gpt2", "bert", "llama"])
    parser.add_argument("--backend", default="ort", choices=["eager", "ort", "ort_recompute"])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--no-copy", action="store_true",
                        help="train the built model itself, not a deep copy (no freed heap left behind)")
    parser.add_argument("--arena", default="",
                        help="comma-separated KEY=VALUE overriding ort_dynamo's shared-arena settings")
    args = parser.parse_args()
    if args.arena:
        from ort_dynamo import run as run_stage

        settings = dict(item.split("=") for item in args.arena.split(","))
        unknown = set(settings) - set(run_stage._SHARED_ARENA_CONFIG)
        if unknown:
            parser.error(f"--arena: unknown keys {sorted(unknown)}; known: {sorted(run_stage._SHARED_ARENA_CONFIG)}")
        run_stage._SHARED_ARENA_CONFIG.update({key: int(value) for key, value in settings.items()})

    warm_backend(args.backend, "cpu")
    model, batch = build(args.model, "cpu")
    # --no-copy: the model itself trains, as in a user's script; else a copy (eager too), as in
    # train_step.py --memory, and the original is freed.
    _, fn = compiled_copy(model, args.backend, copy_model=not args.no_copy)
    del model
    opt = torch.optim.AdamW(fn.parameters(), lr=1e-4)
    start = _rss_mb()
    arena = f", arena {args.arena}" if args.arena else ""
    print(f"{args.model} {args.backend}{arena}: RSS MB over the first step's start (current / peak of the phase)")
    for step in range(args.steps):
        row = []
        for phase in ("forward", "backward", "optimizer"):
            _reset_peak_rss()
            if phase == "forward":
                loss = fn(**batch).loss
            elif phase == "backward":
                loss.backward()
            else:
                opt.step()
                opt.zero_grad(set_to_none=True)
            row.append(f"{phase} {_rss_mb() - start:6.1f} / {_peak_rss_mb() - start:6.1f}")
        print(f"step {step}: " + " | ".join(row))


if __name__ == "__main__":
    main()
