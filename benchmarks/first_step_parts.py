"""Where a first training step's seconds go: one fresh process, one model, one backend.

    .venv/bin/python benchmarks/first_step_parts.py --model bert --backend ort --cache-dir /tmp/c
    .venv/bin/python benchmarks/first_step_parts.py --model bert --backend aot_eager

Run ort twice with the same empty --cache-dir for a cold and then a warm first step. Prints the
step's seconds and the seconds spent inside each part below (a part's time includes the parts it
calls: AOTAutograd's includes the min-cut, compile includes partition, export and rewrite), the
time Python's garbage collector paused the step, and each full collection (the slow kind: it
walks every object of the process) with the part it interrupted; then how many objects the
process tracks after the step, and how long a full collection of them takes. Parts a backend
does not reach print nothing. The step is the same as train_step.py's first step (torch AdamW).
"""

from __future__ import annotations

import argparse
import collections
import functools
import gc
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

import train_step  # noqa: E402

import ort_dynamo  # noqa: E402

#: (module, attribute, label), in the order a first step reaches them.
PARTS = [
    ("torch._functorch.aot_autograd", "aot_module_simplified", "AOTAutograd (trace, partition)"),
    ("ort_dynamo.lower", "decomposition_table", "  decomposition table"),
    ("torch._functorch.partitioners", "min_cut_rematerialization_partition", "  min-cut partitioner"),
    ("ort_dynamo.capture", "compile_graph", "ort_dynamo compile (all graphs)"),
    ("ort_dynamo.partition", "partition", "  partition"),
    ("ort_dynamo.export", "export_graph", "  export"),
    ("ort_dynamo.rewrite", "rewrite", "  rewrite"),
    ("ort_dynamo.run", "OrtRunner._session", "sessions"),
    ("ort_dynamo.run", "OrtRunner._run", "ORT runs (sessions included)"),
]


#: The parts running now, innermost last (where a garbage collection lands).
_running: list[str] = []


def _timed(seconds: collections.Counter, label: str, function):
    @functools.wraps(function)
    def timed(*args, **kwargs):
        start = time.perf_counter()
        _running.append(label.strip())
        try:
            return function(*args, **kwargs)
        finally:
            _running.pop()
            seconds[label] += time.perf_counter() - start
    return timed


def instrument(seconds: collections.Counter) -> None:
    import importlib

    import torch._dynamo.backends.common as dynamo_common

    for module_name, attribute, label in PARTS:
        owner = importlib.import_module(module_name)
        *path, name = attribute.split(".")
        for part in path:
            owner = getattr(owner, part)
        setattr(owner, name, _timed(seconds, label, getattr(owner, name)))
    # Bound by name at import: Dynamo's aot_autograd helper and ours read the patched one.
    dynamo_common.aot_module_simplified = importlib.import_module(
        "torch._functorch.aot_autograd").aot_module_simplified


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="bert")
    parser.add_argument("--backend", default="ort", help="ort, ort_keep, aot_eager, inductor, ...")
    parser.add_argument("--cache-dir", default="", help="ort's on-disk cache (empty: none)")
    args = parser.parse_args()
    seconds = collections.Counter()
    instrument(seconds)
    paused, full = [0.0, 0.0], []

    def on_collection(phase, info):
        if phase == "start":
            paused[1] = time.perf_counter()
            return
        took = time.perf_counter() - paused[1]
        paused[0] += took
        if info["generation"] == 2:
            full.append((took, info["collected"], _running[-1] if _running else "outside the parts"))

    model, batch = train_step.build(args.model, "cpu")
    clone, step_fn = train_step.compiled_copy(model, args.backend, args.cache_dir)
    optimizer = train_step.make_optimizer(args.backend, clone, argparse.Namespace(optimizer="adamw"))
    gc.callbacks.append(on_collection)
    total = train_step.train_step(step_fn, optimizer, batch, "cpu", False)
    gc.callbacks.remove(on_collection)
    exports = ort_dynamo.report().exports if args.backend.startswith("ort") else 0
    print(f"{args.model} {args.backend}: first step {total:.2f} s"
          + (f" ({exports} exports)" if args.backend.startswith("ort") else ""))
    for _, _, label in PARTS:
        if label in seconds:
            print(f"  {label:34s} {seconds[label]:6.3f} s")
    print(f"  {'garbage collector pauses':34s} {paused[0]:6.3f} s")
    for took, collected, where in full:
        print(f"    full collection {took:.3f} s ({collected} objects freed) during: {where}")
    # What the compiled model leaves for every later full collection to walk.
    gc.collect()
    start = time.perf_counter()
    gc.collect()
    print(f"  after the step: {len(gc.get_objects())} objects tracked, a full collection "
          f"{time.perf_counter() - start:.3f} s")


if __name__ == "__main__":
    main()
