"""What a process's first compiled model costs in memory once: ``train_step.py --memory``'s peak
(RSS of steps 2-4 over the RSS before the first step, a deep copy of the model trained), each in a
fresh process, after more and more of the one-time start-up was done by something else first.

    .venv/bin/python benchmarks/first_memory.py --model bert
    .venv/bin/python benchmarks/first_memory.py --model bert --rounds 3   # medians of three

The warm-ups, each adding to the one before:

- ``none``: the model is the process's first (``train_step.py --memory``'s cold figure);
- ``aot_eager``: a tiny model trained under ``aot_eager`` first: Dynamo's and AOTAutograd's
  one-time start-up done;
- ``+session``: and one ONNX Runtime session made and run (a Relu): ORT's environment, its op
  schemas and kernel registries;
- ``+export``: and one ``torch.onnx.export`` of a tiny model: the exporter's registry of
  torchlib functions;
- ``ort``: a tiny model trained under ``ort`` instead (``train_step.py --memory``'s warm
  figure): all of a first ort compile's one-time work.

Eager's peak, first in a process, is the line to compare with. Each row's drop from the row above
is the part of the first model's figure that start-up took, not training at that batch.

``--mappings`` also splits each row's RSS growth (after step 4 against the base) by what holds
the pages, from ``/proc/self/smaps``: allocations (heap and anonymous memory), and the pages of
each shared library the steps touched first (ONNX Runtime's, libtorch_cpu's, ort_dynamo's
kernels). A library's pages are its code and data mapped from its file: once per process (the
code shared with other processes that load it), and not training memory at any batch.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from train_step import MODELS, _child_memory, warm_backend  # noqa: E402

WARM_UPS = ("none", "aot_eager", "+session", "+export", "ort")
#: ``--mappings``' groups, in print order: what holds a mapping's pages, by its path.
GROUPS = ("allocations", "ONNX Runtime", "libtorch_cpu", "ort_dynamo's kernels", "other files")
_MAPPING = re.compile(r"^[0-9a-f]+-[0-9a-f]+ \S+ \S+ \S+ \S+\s*(.*)$")


def _group(path: str) -> str:
    name = os.path.basename(path)
    if not path or path.startswith("["):
        return "allocations"  # [heap], anonymous mappings, [stack]
    if "onnxruntime" in name:
        return "ONNX Runtime"
    if name.startswith("libtorch_cpu"):
        return "libtorch_cpu"
    if name.startswith(("pointwise_", "torch_blas", "torch_attention")) or "ort_dynamo" in path:
        return "ort_dynamo's kernels"
    return "other files"


def _rss_by_group() -> dict[str, float]:
    """This process's resident MB per ``GROUPS`` entry."""
    sizes = dict.fromkeys(GROUPS, 0.0)
    group = "allocations"
    with open("/proc/self/smaps") as fh:
        for line in fh:
            if (mapping := _MAPPING.match(line)) is not None:
                group = _group(mapping.group(1).strip())
            elif line.startswith("Rss:"):
                sizes[group] += int(line.split()[1]) / 1024
    return sizes


def _one_ort_session() -> None:
    import numpy as np
    import onnxruntime
    from onnx import TensorProto, helper

    value = helper.make_tensor_value_info
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "relu", [value("x", TensorProto.FLOAT, [4])],
                              [value("y", TensorProto.FLOAT, [4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    session.run(None, {"x": np.ones(4, np.float32)})


def _warm_up(upto: str) -> None:
    if upto == "ort":
        warm_backend("ort", "cpu")
        return
    steps = WARM_UPS[1:WARM_UPS.index(upto) + 1]
    if "aot_eager" in steps:
        warm_backend("aot_eager", "cpu")
    if "+session" in steps:
        _one_ort_session()
    if "+export" in steps:
        torch.onnx.export(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()), (torch.randn(2, 8),),
                          dynamo=True, verbose=False)


def _child(model_name: str, backend: str, warm_up: str) -> None:
    """``train_step.py --memory``'s own measurement, after ``warm_up``; then a line of the RSS
    growth per ``GROUPS`` entry (JSON)."""
    import gc

    _warm_up(warm_up)
    gc.collect()
    seen = {}
    _child_memory(model_name, backend, argparse.Namespace(warm_backend=False, device="cpu", autocast=False,
                                                          optimizer="adamw"),
                  at=lambda when: seen.__setitem__(when, _rss_by_group()))
    print("mappings", json.dumps({g: seen["end"][g] - seen["base"][g] for g in GROUPS}))


def _peak(model_name: str, backend: str, warm_up: str) -> tuple[float, dict[str, float]]:
    """The child's peak and its RSS growth per group."""
    out = subprocess.run([sys.executable, __file__, "--child", backend, warm_up, "--model", model_name],
                         capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"first_memory.py: the {backend} process after warm-up {warm_up} failed:\n{out.stderr[-2000:]}")
    lines = out.stdout.strip().splitlines()
    grown = json.loads(lines[-1].removeprefix("mappings "))
    return float(lines[-2].split()[0]), grown  # the peak; then what torch.compile() took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="bert", choices=MODELS)
    parser.add_argument("--rounds", type=int, default=1, help="fresh processes per row; the median is printed")
    parser.add_argument("--mappings", action="store_true",
                        help="also split each row's RSS growth by what holds the pages (allocations, libraries)")
    parser.add_argument("--child", nargs=2, metavar=("BACKEND", "WARM_UP"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.child:
        backend, warm_up = args.child
        if backend not in ("eager", "ort") or warm_up not in WARM_UPS:
            parser.error(f"--child: backend eager or ort, warm-up one of {WARM_UPS}")
        return _child(args.model, backend, warm_up)
    print(f"{args.model}: peak RSS MB of steps 2-4 over the first step's start, "
          f"median of {args.rounds} fresh process(es) per row")

    def median(backend: str, warm_up: str) -> tuple[float, str]:
        """The median peak of ``--rounds`` processes, and the line of their median growth per group."""
        runs = [_peak(args.model, backend, warm_up) for _ in range(args.rounds)]
        grown = {g: statistics.median(run[1][g] for run in runs) for g in GROUPS}
        split = "      RSS grown by step 4: " + ", ".join(f"{g} {mb:.1f}" for g, mb in grown.items())
        return statistics.median(run[0] for run in runs), split

    peak, split = median("eager", "none")
    print(f"  eager, first in the process     {peak:6.1f}")
    if args.mappings:
        print(split)
    above = None
    for warm_up in WARM_UPS:
        peak, split = median("ort", warm_up)
        drop = "" if above is None else f"   ({peak - above:+.1f} against the row above)"
        print(f"  ort after warm-up {warm_up:13s} {peak:6.1f}{drop}")
        if args.mappings:
            print(split)
        above = peak


if __name__ == "__main__":
    main()
