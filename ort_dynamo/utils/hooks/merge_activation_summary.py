"""Merge per-activation statistics files into one file per step, in PyTorch's order.

    python -m ort_dynamo.utils.hooks.merge_activation_summary --pt_dir pt_out --ort_dir ort_out \
        --output_dir merged [--overwrite]

Writes, per step N (and per rank when the dumps have ``rank_<r>/`` folders)::

    merged/merge_pt/step_N_.txt       the PyTorch run's summaries, in PyTorch's order
    merged/merge_ort/step_N_.txt      the ORT run's summaries, in the same order
    merged/side_by_side/step_N_.txt   both, PyTorch left and ORT right, activation by activation
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys

__all__ = ["merge", "main"]

_MISSING = "(not recorded in this run)"


def _steps(run_dir: str) -> list[str]:
    names = [n for n in os.listdir(run_dir) if re.fullmatch(r"step_\d+", n)
             and os.path.isdir(os.path.join(run_dir, n))]
    return sorted(names, key=lambda n: int(n.split("_")[1]))


def _ranks(run_dir: str) -> list[str]:
    return sorted(n for n in os.listdir(run_dir) if re.fullmatch(r"rank_\d+", n))


def _order(step_dir: str) -> list[str]:
    path = os.path.join(step_dir, "order.txt")
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as fh:
        names = [line.strip() for line in fh if line.strip()]
    return list(dict.fromkeys(names))


def _read(step_dir: str, name: str) -> str | None:
    path = os.path.join(step_dir, name)
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as fh:
        return fh.read()


def _side_by_side(left: str | None, right: str | None, width: int) -> str:
    a = (left or _MISSING).rstrip("\n").split("\n")
    b = (right or _MISSING).rstrip("\n").split("\n")
    rows = max(len(a), len(b))
    a += [""] * (rows - len(a))
    b += [""] * (rows - len(b))
    return "".join(f"{x:<{width}} | {y}\n" for x, y in zip(a, b))


def _merge_run_dirs(pt_dir: str, ort_dir: str, output_dir: str) -> list[str]:
    pt_steps = _steps(pt_dir)
    if not pt_steps:
        raise ValueError(f"{pt_dir} has no step_<n> folders: is it a StatisticsSubscriber output_dir?")
    ort_steps = set(_steps(ort_dir))
    default_order = _order(os.path.join(pt_dir, pt_steps[0]))
    written = []
    for sub in ("merge_pt", "merge_ort", "side_by_side"):
        os.makedirs(os.path.join(output_dir, sub), exist_ok=True)
    for step in pt_steps + sorted(ort_steps - set(pt_steps), key=lambda n: int(n.split("_")[1])):
        pt_step, ort_step = os.path.join(pt_dir, step), os.path.join(ort_dir, step)
        # PyTorch's order; activations only the ORT run recorded come last.
        order = _order(pt_step) or default_order
        order = order + [n for n in _order(ort_step) if n not in set(order)]
        merged = {"merge_pt": [], "merge_ort": [], "side_by_side": []}
        for name in order:
            left, right = _read(pt_step, name), _read(ort_step, name)
            merged["merge_pt"].append(left if left is not None else f"{name} {_MISSING}\n")
            merged["merge_ort"].append(right if right is not None else f"{name} {_MISSING}\n")
            width = max(len(line) for line in (left or _MISSING).split("\n"))
            merged["side_by_side"].append(_side_by_side(left, right, width))
        for sub, parts in merged.items():
            path = os.path.join(output_dir, sub, f"{step}_.txt")
            with open(path, "w", encoding="utf-8") as fh:
                fh.write("\n".join(parts))
            written.append(path)
    return written


def merge(pt_dir: str, ort_dir: str, output_dir: str, overwrite: bool = False) -> list[str]:
    """Merge the two runs' dumps into ``output_dir``; returns the files written."""
    for label, path in (("pt_dir", pt_dir), ("ort_dir", ort_dir)):
        if not os.path.isdir(path):
            raise FileNotFoundError(f"{label} {path!r} is not a folder")
    if os.path.exists(output_dir):
        if not overwrite:
            raise FileExistsError(f"output directory {output_dir} already exists; pass --overwrite to replace it")
        shutil.rmtree(output_dir)
    pt_ranks, ort_ranks = _ranks(pt_dir), _ranks(ort_dir)
    if pt_ranks != ort_ranks:
        raise ValueError(f"the runs were recorded on different ranks: {pt_dir} has {pt_ranks or 'none'}, "
                         f"{ort_dir} has {ort_ranks or 'none'}")
    if not pt_ranks:
        return _merge_run_dirs(pt_dir, ort_dir, output_dir)
    written = []
    for rank in pt_ranks:
        written += _merge_run_dirs(os.path.join(pt_dir, rank), os.path.join(ort_dir, rank),
                                   os.path.join(output_dir, rank))
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ort_dynamo.utils.hooks.merge_activation_summary",
        description="Merge StatisticsSubscriber dumps of a PyTorch run and an ORT run per step.")
    parser.add_argument("--pt_dir", required=True, help="output_dir of the PyTorch (eager) run")
    parser.add_argument("--ort_dir", required=True, help="output_dir of the ort run")
    parser.add_argument("--output_dir", required=True, help="folder for the merged summaries")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output_dir")
    args = parser.parse_args(argv)
    try:
        written = merge(args.pt_dir, args.ort_dir, args.output_dir, args.overwrite)
    except (OSError, ValueError) as exc:
        print(f"merge_activation_summary: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {len(written)} file(s) under {args.output_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
