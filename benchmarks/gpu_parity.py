"""Training parity of ort variants against eager, each variant in a fresh process.

A variant is ``label=JSON``: ort_dynamo options, plus two keys of this script's own:
``"_side_stream": true`` trains under ``torch.cuda.stream(side)`` instead of PyTorch's
default stream, and ``"_second": true`` first trains one step of another model compiled with
the default options in the same process (as ``train_step.py`` compiles several). Each
process trains an eager copy and a compiled copy of the same model on the same batch, step by
step, and prints both losses per step and the largest relative gap.

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


def _child(model_name: str, device: str, steps: int, options: dict) -> None:
    side = options.pop("_side_stream", False)
    second = options.pop("_second", False)
    torch.manual_seed(0)
    model, batch = bench.build(model_name, device)
    args = argparse.Namespace(optimizer="adamw")
    if second:
        other = torch.compile(copy.deepcopy(model), backend="ort")
        bench.train_step(other, bench.make_optimizer("ort", model, args), batch, device, True)
    twin = copy.deepcopy(model)
    compiled = torch.compile(twin, backend="ort", **({"options": options} if options else {}))
    opts = {"eager": bench.make_optimizer("eager", model, args), "ort": bench.make_optimizer("ort", twin, args)}
    stream = torch.cuda.Stream() if side else None
    rows = []
    for _ in range(steps):
        losses = {"eager": [], "ort": []}
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            bench.train_step(model, opts["eager"], batch, device, True, losses["eager"])
            bench.train_step(compiled, opts["ort"], batch, device, True, losses["ort"])
        rows.append((float(losses["eager"][0]), float(losses["ort"][0])))
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
        gap = max(abs(o - e) / abs(e) for e, o in result["losses"])
        steps = " ".join(f"{e:.4f}/{o:.4f}" for e, o in result["losses"])
        print(f"{label:12s} largest gap {gap:.2e}  fallback nodes {result['fallback_nodes']}  eager/ort: {steps}",
              flush=True)


if __name__ == "__main__":
    main()
