"""torch's BLAS inside ORT: each product cut into pieces for ORT's threads (the default, one
MKL call per thread) against each product handed whole to MKL's own threads, next to eager.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/blas_pieces.py --models bert --rounds 15

Only where ``cpu_matmul`` takes torch's BLAS (Intel CPUs with MKL, or ``cpu_matmul=torch_blas``).
One compiled copy serves both: the piece count is the library's own setting, changed between
steps, which alternate with eager's so that a shared VM's noise hits all three alike. Prints
median ms per step and the ratios.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from train_step import MODELS, _steady_malloc, build, compiled_copy  # noqa: E402

from ort_dynamo import _torch_blas  # noqa: E402
from ort_dynamo.options import OrtOptions  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="bert", help="comma-separated, of train_step.py's models")
    parser.add_argument("--rounds", type=int, default=15, help="timed steps of each kind")
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    models = args.models.split(",")
    if unknown := [m for m in models if m not in MODELS]:
        parser.error(f"--models: unknown {unknown}; choose from {list(MODELS)}")
    if args.rounds < 1 or args.warmup < 0:
        parser.error("--rounds must be at least 1 and --warmup at least 0")
    if not _torch_blas.applies(OrtOptions(), "cpu"):
        sys.exit("torch's BLAS does not apply here (cpu_matmul='auto' takes ORT's MLAS): nothing to compare")
    _steady_malloc()
    library = _torch_blas.library()
    pieces = _torch_blas._usable_cpus()
    kinds = {"eager": None, f"ort, {pieces} pieces": pieces, "ort, MKL's threads": 1}
    for name in models:
        model, batch = build(name, "cpu")
        eager = compiled_copy(model, "eager")
        ort = compiled_copy(model, "ort")
        runs = {kind: (eager if count is None else ort) for kind, count in kinds.items()}
        optimizers = {id(m): torch.optim.AdamW(m.parameters(), lr=1e-4) for m, _ in (eager, ort)}

        def step(kind: str) -> float:
            model_copy, fn = runs[kind]
            if kinds[kind] is not None:
                _torch_blas.hand_in(library, kinds[kind])
            opt = optimizers[id(model_copy)]
            start = time.perf_counter()
            fn(**batch).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return time.perf_counter() - start

        order = list(kinds)
        for _ in range(args.warmup):
            for kind in order:
                step(kind)
        times = {kind: [] for kind in order}
        for r in range(args.rounds):
            for kind in order[r % 3:] + order[:r % 3]:  # rotated: none always follows the same one
                times[kind].append(step(kind))
        ms = {kind: statistics.median(t) * 1e3 for kind, t in times.items()}
        pieced, whole = ms[order[1]], ms[order[2]]
        print(f"{name:8s} " + "  ".join(f"{k} {v:.1f} ms" for k, v in ms.items())
              + f" | pieces/eager {pieced / ms['eager']:.3f}  MKL's threads/eager {whole / ms['eager']:.3f}"
              + f"  MKL's threads/pieces {whole / pieced:.3f}")
        _torch_blas.hand_in(library, pieces)


if __name__ == "__main__":
    main()
