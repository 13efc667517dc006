"""The working tree's ort against a git revision's, interleaved in one process, next to eager.

    .venv/bin/python benchmarks/compare_revision.py --rev HEAD~1 --models gpt2,bert --steps 25
    .venv/bin/python benchmarks/compare_revision.py --rev HEAD --options memory_opt_level=1
    # the working tree with recompute against the revision without
    .venv/bin/python benchmarks/compare_revision.py --rev HEAD --options memory_opt_level=1 --rev-options ""
    # with attention dropout, as the models' own configs have it
    .venv/bin/python benchmarks/compare_revision.py --rev HEAD --attention-dropout 0.1
    # under torch.autocast(bfloat16), as HF's Trainer trains with bf16=True on a CPU
    .venv/bin/python benchmarks/compare_revision.py --rev HEAD --autocast
    # compiled with dynamic=True: symbolic batch and sequence length
    .venv/bin/python benchmarks/compare_revision.py --rev HEAD --dynamic
    # hf_models.py's architectures too, each compile order once
    .venv/bin/python benchmarks/compare_revision.py --rev HEAD~1 --models resnet,mobilenet_v2 --both-orders

On a shared VM, step times move by several percent between runs of the same code, more than
most single changes gain; separate runs cannot tell them apart. Here the revision's package is
extracted (``git archive``) and imported as ``ort_dynamo_rev``, both train their own copy of the
same model on the same batches, and their steps alternate with eager's, so noise hits all
alike. Prints medians and the ratio new/rev. It compares the compiled model: with
``--optimizer fastest`` both copies step with the working tree's FusedAdam.

The two compiled copies share the model's code objects, and Dynamo checks the guards of the copy
compiled last first: each step of the other copy first fails them. That favours the copy compiled
last (ResNet, 2026-12-08: about 2-3% of its step). The revision is compiled first by default;
``--both-orders`` measures again with the working tree first and prints the geometric mean.
"""

from __future__ import annotations

import argparse
import copy
import functools
import importlib
import math
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile

import torch

sys.path.insert(0, os.path.dirname(__file__))
from train_step import MODELS, _steady_malloc, build, key_values, make_optimizer, train_step  # noqa: E402

import ort_dynamo  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def import_revision(rev: str, folder: str):
    """``ort_dynamo`` as of ``rev``, importable as ``ort_dynamo_rev`` (the package only uses
    relative imports, so a renamed copy is self-contained)."""
    archive = os.path.join(folder, "rev.tar")
    with open(archive, "wb") as fh:
        subprocess.run(["git", "archive", rev, "ort_dynamo"], cwd=ROOT, stdout=fh, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(folder, filter="data")
    os.rename(os.path.join(folder, "ort_dynamo"), os.path.join(folder, "ort_dynamo_rev"))
    sys.path.insert(0, folder)
    return importlib.import_module("ort_dynamo_rev")


def _architectures() -> dict:
    """hf_models.py's architectures: name -> (model builder, batch builder)."""
    from hf_models import _configs

    return _configs()


def _model(name: str, args) -> tuple:
    """(model, batch): train_step.py's models, else hf_models.py's architectures."""
    if name in MODELS:
        return build(name, "cpu", args.attention_dropout)
    make_model, make_batch = _architectures()[name]
    torch.manual_seed(0)
    model = make_model().train()
    return model, make_batch(model)


def compare(name: str, rev_package, args, new_first: bool = False) -> dict:
    """Median ms per step of each; ``new_first``: the working tree's copy compiled first."""
    model, batch = _model(name, args)
    runners = {}
    compiled = [("rev", rev_package), ("new", ort_dynamo)]
    for label, package in (compiled[::-1] if new_first else compiled) + [("eager", None)]:
        clone = copy.deepcopy(model)
        options = args.rev_options if label == "rev" else args.options
        backend = functools.partial(package.capture.ort_backend, options=options) if package else None
        fn = clone if package is None else torch.compile(clone, backend=backend, dynamic=args.dynamic or None)
        opt = make_optimizer("eager" if package is None else "ort", clone, args)
        for step in range(args.warmup):
            train_step(fn, opt, batch, "cpu", args.autocast)
            if step == 0 and package is not None:
                package.wait_for_kernels()  # steady state: the kernels' sessions from here on
        runners[label] = (fn, opt)
    times = {label: [] for label in runners}
    for _ in range(args.steps):
        for label, (fn, opt) in runners.items():
            times[label].append(train_step(fn, opt, batch, "cpu", args.autocast))
    return {label: statistics.median(t) * 1e3 for label, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rev", default="HEAD", help="git revision to compare the working tree with")
    parser.add_argument("--models", default="gpt2,bert,llama")
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--optimizer", choices=["adamw", "fastest"], default="fastest")
    parser.add_argument("--attention-dropout", type=float, default=0.0,
                        help="each attention probability's chance of being dropped (the models' configs: 0.1)")
    parser.add_argument("--autocast", action="store_true", help="train under torch.autocast(bfloat16)")
    parser.add_argument("--dynamic", action="store_true", help="compile with dynamic=True (symbolic shapes)")
    parser.add_argument("--options", default="",
                        help="comma-separated KEY=VALUE ort_dynamo options for both, e.g. memory_opt_level=1")
    parser.add_argument("--rev-options", default=None,
                        help="the revision's options instead of --options' (\"\": its defaults)")
    parser.add_argument("--both-orders", action="store_true",
                        help="measure each model twice, the revision compiled first, then the working tree")
    args = parser.parse_args()
    if not 0.0 <= args.attention_dropout < 1.0:
        parser.error("--attention-dropout must be in [0, 1)")
    try:
        args.options = key_values(args.options)
        args.rev_options = args.options if args.rev_options is None else key_values(args.rev_options)
    except ValueError as exc:
        parser.error(f"--options/--rev-options: {exc}")
    if args.warmup < 1:
        parser.error("--warmup must be at least 1 (the first step compiles)")
    others = [name for name in args.models.split(",") if name not in MODELS]
    if others:
        known = _architectures()
        if unknown := [name for name in others if name not in known]:
            parser.error(f"--models: unknown {', '.join(map(repr, unknown))}: "
                         f"one of {', '.join(MODELS + tuple(known))}")
        if args.attention_dropout:
            parser.error(f"--attention-dropout applies to {', '.join(MODELS)} only")
    _steady_malloc()
    with tempfile.TemporaryDirectory() as folder:
        rev_package = import_revision(args.rev, folder)
        print(f"working tree against {args.rev}, optimizer {args.optimizer}, options {args.options} "
              f"{'bfloat16 autocast, ' if args.autocast else ''}{'dynamic shapes, ' if args.dynamic else ''}"
              f"(revision's {args.rev_options}), "
              f"median of {args.steps} steps")
        for name in args.models.split(","):
            ratios = []
            for new_first in (False, True) if args.both_orders else (False,):
                ms = compare(name, rev_package, args, new_first)
                ratios.append(ms["new"] / ms["rev"])
                order = (" (new compiled first)" if new_first else " (rev compiled first)") if args.both_orders else ""
                print(f"{name:6s} rev {ms['rev']:7.1f} ms  new {ms['new']:7.1f} ms  eager {ms['eager']:7.1f} ms | "
                      f"new/rev {ratios[-1]:.3f}  rev/eager {ms['rev'] / ms['eager']:.3f}  "
                      f"new/eager {ms['new'] / ms['eager']:.3f}{order}", flush=True)
            if args.both_orders:
                print(f"{name:6s} new/rev, geometric mean of both orders: {math.sqrt(ratios[0] * ratios[1]):.3f}",
                      flush=True)


if __name__ == "__main__":
    main()
