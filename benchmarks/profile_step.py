"""Where a training step's time goes on ORT: kernel milliseconds per ONNX op type and the
heaviest nodes (ORT's profiler), next to the wall time of forward, backward and optimizer
for ort and eager, each measured in its own run of this script, and eager's GEMMs, fused attention
and the rest (torch's profiler).

    .venv/bin/python benchmarks/profile_step.py --model llama
    .venv/bin/python benchmarks/profile_step.py --model bert --autocast   # under bfloat16 autocast
    .venv/bin/python benchmarks/profile_step.py --model bert --floor     # ... and the step's lower bound
    python3 benchmarks/profile_step.py --device cuda --model gpt2-124m     # GPU machine (autocast)

``--floor`` (CPU, float32) bounds what any change of ort's can reach: the step's products at
the machine's product peak (``product_peak``: torch's GEMM on one thread, whose best is the
core's FMA rate, times the threads), plus ort's attention and optimizer as measured, and
nothing else, against eager's step. Attention is ORT's nodes whose op names it (ort_dynamo's
attention kernels); attention written out as separate ops counts as "nothing else", which only
lowers the floor.

On CUDA ORT's node times are launch times (stock builds have no CUDA profiling), so there it
says where ORT placed each node (the CPU provider's nodes, and the copies ORT added to reach
them), eager's GPU kernel time per kind, and then, for each backend, every CUDA kernel's GPU
time (CUPTI, through torch's profiler: ORT's kernels and ort_dynamo's too) and how busy the GPU
was over the step.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import math
import statistics
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from train_step import MODELS, _steady_malloc, build, compiled_copy, train_step  # noqa: E402

import ort_dynamo  # noqa: E402
from ort_dynamo import run as run_stage  # noqa: E402


def _now(device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def _warmed(name: str, backend: str, device: str, autocast: bool) -> tuple:
    """(compiled copy, optimizer, batch) of ``name`` for ``backend`` after 3 warm-up steps, its
    kernels built and one more step run with them (which makes the sessions that use them)."""
    model, batch = build(name, device)
    _, fn = compiled_copy(model, backend)
    opt = torch.optim.AdamW(fn.parameters(), lr=1e-4)
    for _ in range(3):
        train_step(fn, opt, batch, device, autocast)
    ort_dynamo.wait_for_kernels()
    train_step(fn, opt, batch, device, autocast)
    return fn, opt, batch


def phase_times(name: str, backend: str, steps: int, autocast: bool = False, device: str = "cpu") -> dict:
    """Mean wall ms of forward, backward and optimizer step, after the warm-up (``_warmed``)."""
    fn, opt, batch = _warmed(name, backend, device, autocast)
    totals = collections.Counter()
    for _ in range(steps):
        t0 = _now(device)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            loss = fn(**batch).loss
        t1 = _now(device)
        loss.backward()
        t2 = _now(device)
        opt.step()
        opt.zero_grad(set_to_none=True)
        t3 = _now(device)
        totals.update(forward=t1 - t0, backward=t2 - t1, optimizer=t3 - t2)
    return {k: v / steps * 1e3 for k, v in totals.items()}


@contextlib.contextmanager
def profiled_sessions(folder: str):
    """Every ORT session made inside profiles its runs into ``folder``; yields the list of
    runners made, whose sessions' ``end_profiling()`` gives the files."""
    runners = []
    make_options, make_runner = run_stage.session_options, run_stage.OrtRunner.__init__

    def profiled_options(*args, **kwargs):
        so = make_options(*args, **kwargs)
        so.enable_profiling = True
        so.profile_file_prefix = os.path.join(folder, "ort")
        return so

    def recorded_runner(self, *args, **kwargs):
        make_runner(self, *args, **kwargs)
        runners.append(self)

    run_stage.session_options, run_stage.OrtRunner.__init__ = profiled_options, recorded_runner
    try:
        yield runners
    finally:
        run_stage.session_options, run_stage.OrtRunner.__init__ = make_options, make_runner


def heaviest_ort_nodes(make_step, steps: int = 10, top: int | None = 6) -> list[tuple[float, str]]:
    """(median ms, "op output-shape") of ORT's ``top`` heaviest nodes (None: all) over ``steps``
    calls of the step ``make_step()`` returns, compiled afresh into profiled sessions after a
    first call and the kernels' build (the sessions the kernels replaced left out)."""
    with tempfile.TemporaryDirectory() as folder, profiled_sessions(folder) as runners:
        ort_dynamo.reset()
        torch._dynamo.reset()
        step = make_step()
        step()
        ort_dynamo.wait_for_kernels()
        for _ in range(steps):
            step()
        durations = collections.defaultdict(list)
        for runner in runners:
            for session, *_ in runner._sessions.values():
                with open(session.end_profiling()) as fh:
                    for event in json.load(fh):
                        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
                            shape = json.dumps(event["args"].get("output_type_shape", ""))
                            durations[(event["name"], f"{event['args'].get('op_name')} {shape}")].append(event["dur"])
    ran = {key: times for key, times in durations.items() if len(times) >= steps}  # not replaced ones
    return sorted(((statistics.median(times) / 1e3, key[1]) for key, times in ran.items()), reverse=True)[:top]


def ort_kernel_profile(name: str, steps: int, folder: str, autocast: bool = False, device: str = "cpu") -> tuple:
    with profiled_sessions(folder) as runners:
        torch._dynamo.reset()  # compile again, into profiled sessions
        model, batch = build(name, device)
        _, fn = compiled_copy(model, "ort")
        opt = torch.optim.AdamW(fn.parameters(), lr=1e-4)
        train_step(fn, opt, batch, device, autocast)
        ort_dynamo.wait_for_kernels()  # the kernels' sessions replace the interim ones from here
        for _ in range(steps):
            train_step(fn, opt, batch, device, autocast)
        # Only the sessions that ran these steps (not the interim ones the kernels replaced).
        paths = [session.end_profiling() for runner in runners for session, *_ in runner._sessions.values()]
    per_op, calls, per_node = collections.Counter(), collections.Counter(), collections.Counter()
    session = collections.Counter()
    placed = collections.Counter()  # (provider, op) -> nodes, counted once per session
    per_gemm = collections.defaultdict(lambda: [0.0, 0.0])  # operand shapes -> [ms, FLOP] per step
    for path in paths:
        with open(path) as fh:
            events = json.load(fh)
        # Per run of this session: one without kernels to wait for also ran the warm-up step.
        runs = max(1, sum(1 for e in events if e.get("cat") == "Session" and e["name"] == "model_run"))
        nodes = {e["name"]: e["args"] for e in events
                 if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and "provider" in e["args"]}
        placed.update((args["provider"], args["op_name"]) for args in nodes.values())
        for event in events:
            if event.get("cat") == "Session" and event["name"] == "model_run":
                session["ms"] += event["dur"] / 1e3 / runs
                session["runs"] += 1 / runs
            if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
                op = event["args"].get("op_name")
                per_op[op] += event["dur"] / 1e3 / runs
                calls[op] += 1 / runs
                shapes = json.dumps(event["args"].get("output_type_shape", ""))[:70]
                per_node[f"{op} {shapes}"] += event["dur"] / 1e3 / runs
                if op in ("MatMul", "FusedMatMul", "Gemm") or op.startswith(("Bf16MatMul", "F32MatMul")):
                    ms, flop = event["dur"] / 1e3 / runs, _gemm_flop(event["args"]) / runs
                    session["gemm_ms"] += ms
                    session["gemm_flop"] += flop
                    a, b = [list(d.values())[0] for d in event["args"]["input_type_shape"][:2]]
                    out = list(event["args"]["output_type_shape"][0].values())[0]
                    entry = per_gemm[f"{op} {a} x {b} -> {out}"]
                    entry[0] += ms
                    entry[1] += flop
    return per_op, calls, per_node, session, per_gemm, placed


def eager_profile(name: str, steps: int, autocast: bool = False, device: str = "cpu") -> dict:
    """Eager's step per kind of ATen op (torch's profiler, self ms per step on ``device``): its
    GEMMs, its fused attention, and all the rest. Eager does the same products as ORT, so this
    says how much of eager's step ORT could shrink at all."""
    from torch.profiler import ProfilerActivity, profile

    model, batch = build(name, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for _ in range(3):
        train_step(model, opt, batch, device, autocast)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            train_step(model, opt, batch, device, autocast)
    kinds = collections.Counter()
    for event in prof.key_averages():
        kind = ("gemm" if event.key in ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")
                else "attention" if event.key.startswith("aten::_scaled_dot_product") else "rest")
        own = event.self_device_time_total if device == "cuda" else event.self_cpu_time_total
        kinds[kind] += own / 1e3 / steps
    return kinds


#: Kinds of CUDA kernels by name (CUPTI's names: cuBLAS/CUTLASS products, PyTorch's and ORT's
#: templates); ort_dynamo's generated kernels are the ``pw_`` ones (``_kernel_kind``).
_KERNEL_KINDS = (
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("products", ("gemm", "cutlass", "xmma", "cublas", "sm80_", "sm90_", "sm100_", "nvjet", "matmul")),
    ("reductions and norms", ("reduce", "softmax", "norm", "welford")),
    ("casts and copies", ("cast", "copy", "memcpy", "transpose", "concat", "gather", "scatter")),
)


def _kernel_kind(kernel: str) -> str:
    lower = kernel.lower()
    if lower.startswith("pw_"):  # a prefix: "pw_" inside another library's name is not ours
        return "ort_dynamo kernels"
    return next((kind for kind, marks in _KERNEL_KINDS if any(m in lower for m in marks)), "elementwise and other")


def gpu_kernel_profile(name: str, backend: str, steps: int) -> tuple[float, collections.Counter, collections.Counter]:
    """``backend``'s training step (bf16 autocast) as the GPU ran it: torch's profiler records
    every CUDA kernel of the process through CUPTI, ORT's and ort_dynamo's included, with its
    time on the GPU. Returns (wall ms per step, GPU ms per step per kernel name, per kind). GPU
    time well under the wall time means the GPU waited for the host."""
    from torch.profiler import ProfilerActivity, profile

    fn, opt, batch = _warmed(name, backend, "cuda", True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = _now("cuda")
        for _ in range(steps):
            train_step(fn, opt, batch, "cuda", True)
        wall = (_now("cuda") - start) / steps * 1e3
    per_kernel = collections.Counter()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[event.name] += event.device_time_total / 1e3 / steps
    kinds = collections.Counter()
    for kernel, ms in per_kernel.items():
        kinds[_kernel_kind(kernel)] += ms
    return wall, per_kernel, kinds


def product_peak(threads: int, seconds: float = 0.3) -> tuple[float, float]:
    """(GF/s of one thread, GF/s of ``threads``): the best float32 product rate torch reaches on
    one thread over a few square sizes (MKL's comes within a few percent of a core's FMA
    rate), times ``threads``, assuming perfect scaling: an upper bound for any product here."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        best = 0.0
        for n in (512, 1024, 2048):
            a, b = torch.randn(n, n), torch.randn(n, n)
            a @ b
            calls, start = 0, time.perf_counter()
            while time.perf_counter() - start < seconds:
                a @ b
                calls += 1
            best = max(best, 2 * n**3 * calls / (time.perf_counter() - start) / 1e9)
    finally:
        torch.set_num_threads(before)
    return best, best * threads


def step_floor(product_gflop: float, product_ms: float, peak_gflops: float, attention_ms: float,
               ort_phases: dict, eager_phases: dict) -> dict:
    """ort's step with its products (``product_gflop``, taking ``product_ms`` now) at
    ``peak_gflops`` and nothing but them, its attention and its optimizer: a lower bound, in ms
    and as a ratio of eager's step; and the share of that peak the products reach now."""
    products_ms = product_gflop / peak_gflops * 1e3
    floor = products_ms + attention_ms + ort_phases["optimizer"]
    eager = sum(eager_phases.values())
    return {"products_ms": products_ms, "floor_ms": floor, "eager_ms": eager, "ratio": floor / eager,
            "share_of_peak": products_ms / product_ms}


def _gemm_flop(args: dict) -> int:
    """2*M*N*K of a product from its profiled shapes (K: A's elements over the output rows)."""
    a = list(args["input_type_shape"][0].values())[0]
    out = list(args["output_type_shape"][0].values())[0]
    rows = math.prod(out[:-1])
    return 2 * rows * out[-1] * (math.prod(a) // rows if rows else 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="llama", choices=MODELS + ("gpt2-124m",))
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--autocast", action="store_true", help="train under torch.autocast(bfloat16)")
    parser.add_argument("--phase-backends", default="eager,ort",
                        help="comma-separated backends whose phase times to measure, each in turn")
    parser.add_argument("--floor", action="store_true",
                        help="CPU, float32: ort's step with its products at the machine's peak and nothing "
                             "else but attention and optimizer, against eager's (see above)")
    args = parser.parse_args()
    args.autocast = args.autocast or args.device == "cuda"
    phase_backends = args.phase_backends.split(",")
    if args.floor and (args.device != "cpu" or args.autocast or not {"eager", "ort"} <= set(phase_backends)):
        parser.error("--floor is for float32 CPU steps and needs eager and ort among --phase-backends")
    _steady_malloc()  # as train_step.py: no backend pays page faults for another's frees
    phases = {}
    for backend in phase_backends:
        t = phases[backend] = phase_times(args.model, backend, args.steps, args.autocast, args.device)
        print(f"{backend:9s} forward {t['forward']:6.1f} ms  backward {t['backward']:6.1f} ms  "
              f"optimizer {t['optimizer']:5.1f} ms  total {sum(t.values()):6.1f} ms")
    kinds = eager_profile(args.model, args.steps, args.autocast, args.device)
    print(f"eager per step (torch's profiler, {args.device} time): GEMMs {kinds['gemm']:.1f} ms, fused attention "
          f"{kinds['attention']:.1f} ms, the rest {kinds['rest']:.1f} ms, of {sum(kinds.values()):.1f} ms")
    with tempfile.TemporaryDirectory() as folder:
        per_op, calls, per_node, session, per_gemm, placed = ort_kernel_profile(
            args.model, args.steps, folder, args.autocast, args.device)
    providers = collections.Counter()
    for (provider, _), count in placed.items():
        providers[provider] += count
    print("ORT's nodes per provider (all sessions): "
          + ", ".join(f"{provider} {count}" for provider, count in providers.most_common()))
    if args.device == "cuda":
        off = [f"{op} {count}" for (provider, op), count in placed.most_common() if provider != "CUDAExecutionProvider"]
        copies = sum(count for (_, op), count in placed.items() if op.startswith("Memcpy"))
        print(f"  not on CUDA: {', '.join(off) or 'none'}; copies ORT added: {copies}")
    print(f"ORT per step: {session['runs']:.0f} session runs taking {session['ms']:.1f} ms, of which "
          f"kernels {sum(per_op.values()):.1f} ms (profiling adds overhead)")
    if session["gemm_ms"]:
        print(f"GEMMs: {session['gemm_ms']:.1f} ms, {session['gemm_flop'] / 1e9:.2f} GFLOP, "
              f"{session['gemm_flop'] / session['gemm_ms'] / 1e6:.0f} GF/s")
        for shapes, (ms, flop) in sorted(per_gemm.items(), key=lambda item: -item[1][0])[:args.top]:
            print(f"  {ms:7.2f} ms  {flop / ms / 1e6:4.0f} GF/s  {shapes}")
    for op, ms in per_op.most_common(args.top):
        print(f"  {op:30s} {ms:7.2f} ms  {calls[op]:5.0f} calls")
    if args.floor and not session["gemm_ms"]:
        print("floor: no products in ORT's profile, nothing to bound")
    elif args.floor:
        threads, gflop = torch.get_num_threads(), session["gemm_flop"] / 1e9
        one, peak = product_peak(threads)
        attention = sum(ms for op, ms in per_op.items() if "Attention" in op)
        f = step_floor(gflop, session["gemm_ms"], peak, attention, phases["ort"], phases["eager"])
        print(f"floor: products {gflop:.2f} GFLOP at {peak:.0f} GF/s ({one:.1f} on one thread x {threads}) "
              f"{f['products_ms']:.1f} ms + attention {attention:.1f} ms + optimizer "
              f"{phases['ort']['optimizer']:.1f} ms = {f['floor_ms']:.1f} ms, {f['ratio']:.2f} of eager's "
              f"{f['eager_ms']:.1f} ms; ort's products now {f['share_of_peak']:.0%} of that peak")
    print("heaviest nodes (op, output shape):")
    for node, ms in per_node.most_common(args.top):
        print(f"  {ms:7.2f} ms  {node}")
    if args.device == "cuda":
        for backend in args.phase_backends.split(","):
            wall, per_kernel, kinds = gpu_kernel_profile(args.model, backend, args.steps)
            busy = sum(kinds.values())
            print(f"{backend} on the GPU (CUPTI): {wall:.1f} ms per step, kernels {busy:.1f} ms "
                  f"({busy / wall:.0%} busy), {sum(1 for _ in per_kernel)} distinct kernels; "
                  + ", ".join(f"{kind} {ms:.1f}" for kind, ms in kinds.most_common()))
            for kernel, ms in per_kernel.most_common(args.top):
                print(f"  {ms:7.2f} ms  {kernel[:110]}")


if __name__ == "__main__":
    main()
