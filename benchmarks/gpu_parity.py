"""Training parity of ort variants against eager, each variant in a fresh process.

A variant is ``label=JSON``: ort_dynamo options, plus keys of this script's own:
``"_side_stream": true`` trains under ``torch.cuda.stream(side)`` instead of PyTorch's
default stream; ``"_second": true`` compiles another copy first, in the same process, with the
default options (or those given: ``"_second": {...}``), and trains it before the others in
every step (as ``train_step.py`` interleaves its copies);
``"_check": true`` also runs every ORT partition's FX graph in PyTorch on the same inputs and
lists the partitions whose outputs differ by more than 5% of their largest value (slow: the
step runs twice, and waits for the GPU after each partition). Each process trains an eager copy
and a compiled copy of the same model on the same batch, step by step, and prints both losses
per step and the largest relative gap.

    python3 benchmarks/gpu_parity.py --model gpt2-124m --steps 8 \\
        'default={}' 'arena={"cuda_allocator": "shared_arena"}' 'unfused={"pointwise_kernels": false}'
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_step as bench  # noqa: E402

import ort_dynamo  # noqa: E402


def _checking_partitions(found: list) -> None:
    """Every ORT partition run from now on is also run in PyTorch (its FX graph, the partition's
    fallback) on the same inputs; ``found`` gets (graph, partition, largest difference relative
    to the largest value) for outputs that differ by more than 5%."""
    from ort_dynamo import run as run_stage

    original = run_stage.OrtRunner.__call__

    def checked(self, *args):
        got = original(self, *args)
        want = self.run_in_pytorch(*args)
        pairs = zip(got, want) if isinstance(got, (tuple, list)) else [(got, want)]
        worst = 0.0
        for g, w in pairs:
            if not isinstance(g, torch.Tensor) or not g.numel():
                continue
            if g.is_floating_point():
                scale = w.float().abs().max().item() + 1e-6
                worst = max(worst, (g.float() - w.float()).abs().max().item() / scale)
            elif not torch.equal(g, w):
                worst = float("inf")
        if worst > 0.05:
            found.append((self.report.name, self.name, worst))
        return got

    run_stage.OrtRunner.__call__ = checked


def _child(model_name: str, device: str, steps: int, options: dict) -> None:
    side = options.pop("_side_stream", False)
    second = options.pop("_second", False)
    check = options.pop("_check", False)
    torch.manual_seed(0)
    model, batch = bench.build(model_name, device)
    args = argparse.Namespace(optimizer="adamw")
    trained = {}  # name: (compiled or eager model, optimizer), trained in this order each step
    if second:
        first = copy.deepcopy(model)
        first_options = second if isinstance(second, dict) else {}
        trained["first"] = (torch.compile(first, backend="ort", **({"options": first_options} if first_options else {})),
                            bench.make_optimizer("ort", first, args))
    mismatches: list = []
    if check:
        _checking_partitions(mismatches)
    twin = copy.deepcopy(model)
    trained["eager"] = (model, bench.make_optimizer("eager", model, args))
    trained["ort"] = (torch.compile(twin, backend="ort", **({"options": options} if options else {})),
                      bench.make_optimizer("ort", twin, args))
    stream = torch.cuda.Stream() if side else None
    rows = []
    for step in range(steps):
        losses = {name: [] for name in trained}
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for name, (fn, optimizer) in trained.items():
                bench.train_step(fn, optimizer, batch, device, True, losses[name])
        rows.append((float(losses["eager"][0]), float(losses["ort"][0])))
        for graph, partition, worst in mismatches:
            print(f"step {step}: {graph}/{partition} differs from PyTorch by {worst:.3g} of its largest value",
                  file=sys.stderr)
        mismatches.clear()
    print(json.dumps({"losses": rows, "fallback_nodes": ort_dynamo.report().fallback_nodes}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("variants", nargs="*", default=["default={}"])
    parser.add_argument("--model", default="gpt2-124m")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        return _child(args.model, args.device, args.steps, json.loads(args.child))
    for variant in args.variants:
        label, _, spec = variant.partition("=")
        json.loads(spec or "{}")  # a bad variant fails here, before any child runs
        out = subprocess.run([sys.executable, __file__, "--model", args.model, "--device", args.device,
                              "--steps", str(args.steps), "--child", spec or "{}"],
                             capture_output=True, text=True, timeout=900)
        if out.returncode != 0:
            print(f"{label:12s} failed: {out.stderr[-1500:]}", flush=True)
            continue
        result = json.loads(out.stdout.strip().splitlines()[-1])
        for line in out.stderr.splitlines():
            if line.startswith("step "):
                print(f"{label:12s} {line}")
        gap = max(abs(o - e) / abs(e) for e, o in result["losses"])
        steps = " ".join(f"{e:.4f}/{o:.4f}" for e, o in result["losses"])
        print(f"{label:12s} largest gap {gap:.2e}  fallback nodes {result['fallback_nodes']}  eager/ort: {steps}",
              flush=True)


if __name__ == "__main__":
    main()
