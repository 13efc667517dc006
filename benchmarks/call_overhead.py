"""Per-call overhead of handing tensors to ORT: a graph with N inputs, microseconds per call.

    .venv/bin/python benchmarks/call_overhead.py --inputs 300 --calls 2000

Compares the compiled graph (``backend="ort"``) with eager on the same tiny work, so the
difference is what ort_dynamo adds per call (wrapping inputs, the run, DLPack outputs).
"""

import argparse
import statistics
import time

import torch

import ort_dynamo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--inputs", type=int, default=300)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    def fn(*xs):
        total = xs[0]
        for x in xs[1:]:
            total = total + x
        return total

    xs = [torch.randn(4, device=args.device) for _ in range(args.inputs)]
    compiled = torch.compile(fn, backend="ort")
    torch.testing.assert_close(compiled(*xs), fn(*xs))
    results = {}
    for name, f in (("eager", fn), ("ort", compiled)):
        for _ in range(50):
            f(*xs)
        samples = []
        for _ in range(args.calls):
            start = time.perf_counter()
            f(*xs)
            samples.append(time.perf_counter() - start)
        results[name] = statistics.median(samples) * 1e6
    report = ort_dynamo.report()
    print(f"{args.inputs} inputs, {args.calls} calls, device {args.device}, ORT runs {report.runs}")
    print(f"median per call: eager {results['eager']:.1f} us, ort {results['ort']:.1f} us "
          f"(ort/eager {results['ort'] / results['eager']:.2f}); "
          f"per input: ort {results['ort'] / args.inputs:.2f} us")


if __name__ == "__main__":
    main()
