"""Where a training step's memory sits: RSS after forward, backward and optimizer, per step,
for one backend in a fresh process (the numbers in docs/performance-log.md, "where ort's extra
megabytes sit").

    .venv/bin/python benchmarks/memory_phases.py --model bert --backend eager
    .venv/bin/python benchmarks/memory_phases.py --model bert --backend ort

Megabytes over the RSS before the first step (as train_step.py --memory counts them), after a
tiny warm-up model so one-time start-up is not counted.

    # the shared arena with other settings (OrtArenaCfg keys; -1: ORT's default)
    .venv/bin/python benchmarks/memory_phases.py --model llama --arena initial_chunk_size_bytes=-1

    # with each backend's fastest optimizer (ort: FusedAdam), as train_step.py --optimizer fastest
    .venv/bin/python benchmarks/memory_phases.py --model bert --optimizer fastest

    # ORT's sessions allocating from malloc, as PyTorch does, instead of the shared arena
    .venv/bin/python benchmarks/memory_phases.py --model bert --no-arena

    # attention as the models' own configs have it (dropout 0.1), or under bf16 autocast
    .venv/bin/python benchmarks/memory_phases.py --model bert --attention-dropout 0.1
    .venv/bin/python benchmarks/memory_phases.py --model bert --autocast

    # live bytes instead of RSS: what is allocated and not yet freed, whatever the allocators
    # keep (glibc only; ORT's arena is turned off so that its tensors are counted one by one)
    .venv/bin/python benchmarks/memory_phases.py --model bert --backend ort --live
    .venv/bin/python benchmarks/memory_phases.py --model bert --backend ort --live --runs   # each ORT run's peak

With --live and ort, the last line says how much the ORT sessions hold: the live bytes freed
when every session (with the model it was made from) is let go after the last step.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(__file__))
from train_step import (MODELS, _peak_rss_mb, _reset_peak_rss, _rss_mb, build, compiled_copy, key_values, make_optimizer,  # noqa: E402
                        warm_backend)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="bert", choices=MODELS)
    parser.add_argument("--backend", default="ort", choices=["eager", "aot_eager", "ort", "ort_keep", "ort_recompute"])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--optimizer", choices=["adamw", "fastest"], default="adamw",
                        help="as train_step.py's: torch AdamW, or each backend's fastest (ort: FusedAdam)")
    parser.add_argument("--no-copy", action="store_true",
                        help="train the built model itself, not a deep copy (no freed heap left behind)")
    parser.add_argument("--arena", default="",
                        help="comma-separated KEY=VALUE overriding ort_dynamo's shared-arena settings")
    parser.add_argument("--live", action="store_true",
                        help="live bytes (malloc'ed, not freed) instead of RSS; ORT's arena off")
    parser.add_argument("--no-arena", action="store_true",
                        help="ORT's sessions allocate from malloc, as PyTorch does (RSS; --live always does)")
    parser.add_argument("--attention-dropout", type=float, default=0.0,
                        help="each attention probability's chance of being dropped (the models' configs: 0.1)")
    parser.add_argument("--autocast", action="store_true", help="forward under torch.autocast('cpu', bfloat16)")
    parser.add_argument("--runs", action="store_true",
                        help="with --live: each ORT run of the last step, live before, its peak, after")
    args = parser.parse_args()
    if args.live and args.arena:
        parser.error("--live turns ORT's arena off: --arena does not apply")
    if args.runs and not args.live:
        parser.error("--runs needs --live")
    if not 0.0 <= args.attention_dropout < 1.0:
        parser.error("--attention-dropout must be in [0, 1)")
    if args.no_arena and args.arena:
        parser.error("--no-arena and --arena exclude each other")
    measure = _live_bytes_counters() if args.live else None
    if args.no_arena and not args.live:
        _sessions_without_arena()
    if args.arena:
        from ort_dynamo import run as run_stage

        try:
            settings = key_values(args.arena)
        except ValueError as exc:
            parser.error(f"--arena: {exc}")
        unknown = set(settings) - set(run_stage._SHARED_ARENA_CONFIG)
        if unknown:
            parser.error(f"--arena: unknown keys {sorted(unknown)}; known: {sorted(run_stage._SHARED_ARENA_CONFIG)}")
        not_ints = sorted(key for key, value in settings.items() if not isinstance(value, int))
        if not_ints:
            parser.error(f"--arena: {not_ints} must be integers")
        run_stage._SHARED_ARENA_CONFIG.update(settings)

    warm_backend(args.backend, "cpu")
    model, batch = build(args.model, "cpu", args.attention_dropout)
    # --no-copy: the model itself trains, as in a user's script; else a copy (eager too), as in
    # train_step.py --memory, and the original is freed.
    _, fn = compiled_copy(model, args.backend, copy_model=not args.no_copy)
    del model
    opt = make_optimizer(args.backend, fn, args)
    now, peak, reset_peak = (measure.now, measure.peak, measure.reset_peak) if measure else \
        (_rss_mb, _peak_rss_mb, _reset_peak_rss)
    start = now()
    setting = f", arena {args.arena}" if args.arena else ""
    what = "live MB (ORT's arena off)" if args.live else "RSS MB"
    setting += f", attention dropout {args.attention_dropout}" if args.attention_dropout else ""
    setting += ", bf16 autocast" if args.autocast else ""
    print(f"{args.model} {args.backend}, {args.optimizer}{setting}: {what} over the first step's start "
          "(current / peak of the phase)")
    runs = _watch_ort_runs(measure, start) if args.runs else None
    for step in range(args.steps):
        if runs is not None:
            runs.clear()
        row = []
        for phase in ("forward", "backward", "optimizer"):
            reset_peak()
            if phase == "forward":
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.autocast):
                    loss = fn(**batch).loss
            elif phase == "backward":
                loss.backward()
            else:
                opt.step()
                opt.zero_grad(set_to_none=True)
            row.append(f"{phase} {now() - start:6.1f} / {peak() - start:6.1f}")
        print(f"step {step}: " + " | ".join(row))
    for line in runs or ():
        print(line)
    if measure is not None and args.backend.startswith("ort"):
        _print_session_bytes(measure)


def _print_session_bytes(live) -> None:
    """Let every ORT session go (and the model bytes only it still holds); print what that frees."""
    import gc

    from ort_dynamo import run as run_stage

    runners = [o for o in gc.get_objects() if type(o) is run_stage.OrtRunner]
    gc.collect()
    before = live.now()
    for runner in runners:
        runner._sessions.clear()
    gc.collect()
    print(f"ORT sessions of {len(runners)} partitions held {before - live.now():.1f} MB")


def _watch_ort_runs(live, start) -> list[str]:
    """A line per ORT run from now on: live MB before it, its peak and after it."""
    from ort_dynamo import run as run_stage

    lines, run = [], run_stage.OrtRunner._run

    def watched(runner, args):
        before = live.now()
        out, run_peak = live.peak_during(lambda: run(runner, args))
        lines.append(f"  run {runner.report.name}/{runner.name}: before {before - start:6.1f} "
                     f"peak {run_peak - start:6.1f} after {live.now() - start:6.1f}")
        return out

    run_stage.OrtRunner._run = watched
    return lines


class _LiveBytes:
    """csrc/live_bytes.c's counters in MB. Its one peak register serves nested intervals: a
    phase's peak (``peak``) and, inside it, each ORT run's (``peak_during``)."""

    def __init__(self, process) -> None:
        self._process, self._floor = process, 0.0

    def now(self) -> float:
        return self._process.live_bytes_now() / 2**20

    def peak(self) -> float:
        return max(self._floor, self._process.live_bytes_peak() / 2**20)

    def reset_peak(self) -> None:
        self._floor = 0.0
        self._process.live_bytes_reset_peak()

    def peak_during(self, fn):
        self._floor = self.peak()  # the enclosing interval's peak so far
        self._process.live_bytes_reset_peak()
        out = fn()
        inner = self._process.live_bytes_peak() / 2**20
        self._floor = max(self._floor, inner)
        return out, inner


def _live_bytes_counters() -> _LiveBytes:
    """Counters from csrc/live_bytes.c, which this process must have been started with: if it
    was not, it is compiled and the script runs again under it."""
    variable = "MEMORY_PHASES_LIVE_BYTES"
    if os.environ.get(variable) != "1":
        folder = tempfile.mkdtemp(prefix="live_bytes_")
        library = os.path.join(folder, "live_bytes.so")
        source = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "live_bytes.c")
        subprocess.run([os.environ.get("CC", "cc"), "-O2", "-shared", "-fPIC", "-o", library, source], check=True)
        env = {**os.environ, variable: "1", "LD_PRELOAD": library}
        sys.stdout.flush()
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    process = ctypes.CDLL(None)
    process.live_bytes_now.restype = process.live_bytes_peak.restype = ctypes.c_long
    # ORT's arena would count as one block: each session allocates from malloc instead.
    _sessions_without_arena()
    return _LiveBytes(process)


def _sessions_without_arena() -> None:
    from ort_dynamo import run as run_stage

    with_arena = run_stage.session_options

    def without_arena(*args, **kwargs):
        so = with_arena(*args, **kwargs)
        so.enable_cpu_mem_arena = False
        return so

    from ort_dynamo.optim import _session as optimizer_sessions

    run_stage._register_shared_cpu_arena = lambda: None
    run_stage.session_options = optimizer_sessions.session_options = without_arena


if __name__ == "__main__":
    main()
