"""Training-step speed of eager, inductor and ort, interleaved in one process.

    python3 dev.py bench                                   # all models, CPU sizes
    .venv/bin/python benchmarks/train_step.py --models gpt2 --steps 20 --warmup 3
    .venv/bin/python benchmarks/train_step.py --device cuda --models gpt2-124m   # GPU machine
    .venv/bin/python benchmarks/train_step.py --autocast      # CPU under torch.autocast(bfloat16)

Models: HF's GPT-2, BERT and Llama, and nanogpt (examples/train_gpt.py's model, attention written
as nanoGPT writes it), all at the CPU sizes below; gpt2-124m for a GPU.

Per model: each backend trains its own copy of the same weights on the same batches; steps
are interleaved (eager, inductor, ort, eager, ...) so machine noise hits all alike. Prints the
median ms/step after warm-up, ort/eager and ort/inductor, first-step (compile) seconds with
ort/aot_eager, and, with --memory, each backend's peak memory measured in a child process
(and, on CPU, what the torch.compile() call itself took before the first step: Inductor's
imports, which the peak figures do not count).
--cache measures first steps each in a fresh process (aot_eager; ort cold; ort with the warm
on-disk cache the cold run left), so no backend inherits another's one-time start-up, in
--first-step-rounds rounds (default 3) whose median ratios are printed; --cache-only measures
only those (each process's figure is printed as it ends).

OpenMP: PyTorch's worker threads (libgomp) keep spinning for a while after each parallel op
unless OMP_WAIT_POLICY=PASSIVE. Stepped one by one, a backend that follows eager's or Inductor's
step shares the cores with those spinning threads, and ORT's threads, which sleep, do not help
the next one in turn: without PASSIVE that costs ort and not the others. PASSIVE makes eager's
own ops wake sleeping threads instead. Neither setting is neutral for one-by-one steps; --block N
runs N steps of a backend in a row, as a training loop does, and times all but the first.

The timing process fixes glibc malloc's thresholds (``--malloc default`` leaves them): by
default, freeing a large block raises glibc's mmap threshold and trims the heap, so one
backend's frees decide whether the next one's large tensors come from the heap or from fresh
mmaps that page-fault on first touch. Interleaved with ort, eager's Llama step measured
260-317 ms that way against 209-219 ms alone; with fixed thresholds, 211-218 ms.
"""

from __future__ import annotations

import argparse
import collections
import copy
import ctypes
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import torch

import ort_dynamo

#: ort with some options set, beside "ort" (the defaults): ``compiled_copy`` says what each is.
ORT_VARIANTS = {
    "ort_keep": {"memory_opt_level": 0}, "ort_recompute": {"memory_opt_level": 1},
    "ort_math_attention": {"cuda_torch_attention": False}, "ort_unfused": {"pointwise_kernels": False},
    "ort_arena": {"cuda_allocator": "shared_arena"}, "ort_whole_backward": {"backward_segments": 1},
    "ort_segmented": {"backward_segments": 8}, "ort_mem_pattern": {"cuda_memory_pattern": True},
    "ort_torch_attention": {"cpu_torch_attention": True}, "ort_written_attention": {"cpu_attention_kernel": False},
    "ort_mlas": {"cpu_matmul": "ort"}, "ort_torch_blas": {"cpu_matmul": "torch_blas"},
    "ort_threads": {"cpu_thread_pool": "ort"}, "ort_torch_threads": {"cpu_thread_pool": "torch"},
}
CPU_SIZE = dict(layers=4, hidden=256, heads=4, seq=128, batch=8, vocab=1024)


def key_values(text: str) -> dict:
    """``"a=1,b=x"`` -> ``{"a": 1, "b": "x"}`` (integers as int); a ValueError names an item
    without ``=``."""
    result = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"{item!r} is not KEY=VALUE")
        result[key] = int(value) if value.lstrip("-").isdigit() else value
    return result


def build(name: str, device: str, attention_dropout: float = 0.0):
    """``attention_dropout``: the probability of dropping each attention probability (the
    models' configs default to 0.1; these benchmarks to 0, so that parity is measurable)."""
    import transformers as tf

    s = CPU_SIZE
    if name == "gpt2":
        cfg = tf.GPT2Config(n_layer=s["layers"], n_embd=s["hidden"], n_head=s["heads"], vocab_size=s["vocab"],
                            n_positions=s["seq"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=attention_dropout)
        model = tf.GPT2LMHeadModel(cfg)
    elif name == "gpt2-124m":
        model = tf.GPT2LMHeadModel(tf.GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=attention_dropout))
    elif name == "bert":
        cfg = tf.BertConfig(num_hidden_layers=s["layers"], hidden_size=s["hidden"], num_attention_heads=s["heads"],
                            intermediate_size=4 * s["hidden"], vocab_size=s["vocab"], max_position_embeddings=s["seq"],
                            hidden_dropout_prob=0.0, attention_probs_dropout_prob=attention_dropout)
        model = tf.BertForMaskedLM(cfg)
    elif name == "nanogpt":
        if attention_dropout:
            raise SystemExit("nanogpt has no attention dropout")
        model = _NanoGPT(s["layers"], s["hidden"], s["heads"], s["seq"])
    elif name == "lstm":
        torch._dynamo.config.allow_rnn = True  # Dynamo captures nn.LSTM only with it
        model = _LstmLM(s["vocab"], s["hidden"], layers=2)
    elif name == "llama":
        cfg = tf.LlamaConfig(num_hidden_layers=s["layers"], hidden_size=s["hidden"], num_attention_heads=s["heads"],
                             num_key_value_heads=s["heads"], intermediate_size=4 * s["hidden"],
                             vocab_size=s["vocab"], max_position_embeddings=s["seq"],
                             attention_dropout=attention_dropout)
        model = tf.LlamaForCausalLM(cfg)
    else:
        raise SystemExit(f"unknown model {name!r}")
    if hasattr(model, "config"):
        model.config.use_cache = False
    seq, batch = {"gpt2-124m": (512, 8), "lstm": (64, 16)}.get(name, (s["seq"], s["batch"]))
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, seq), generator=gen)
    return model.to(device).train(), {"input_ids": ids.to(device), "labels": ids.to(device)}


class _NanoGPT(torch.nn.Module):
    """examples/train_gpt.py's model at these sizes: written as nanoGPT is (one q/k/v
    projection whose heads are split by indexing, SDPA, tied embeddings), not as HF's models."""

    def __init__(self, layers: int, hidden: int, heads: int, seq: int) -> None:
        super().__init__()
        examples = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
        if examples not in sys.path:
            sys.path.insert(0, examples)
        from train_gpt import TinyGPT

        self.gpt = TinyGPT(layers, hidden, heads, seq)
        self.config = argparse.Namespace(vocab_size=self.gpt.tok.num_embeddings)

    def forward(self, input_ids, labels):
        return argparse.Namespace(loss=self.gpt(input_ids, labels))


class _LstmLM(torch.nn.Module):
    """A 2-layer LSTM language model, 16 sequences of 64 tokens: ORT runs it unrolled, so its
    step is many small nodes and products of 16 rows, unlike the transformers'."""

    def __init__(self, vocab: int, hidden: int, layers: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.lstm = torch.nn.LSTM(hidden, hidden, num_layers=layers, batch_first=True)
        self.head = torch.nn.Linear(hidden, vocab)
        self.config = argparse.Namespace(vocab_size=vocab)

    def forward(self, input_ids, labels):
        hidden, _ = self.lstm(self.embed(input_ids))
        logits = self.head(hidden)
        return argparse.Namespace(loss=torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()))


MODELS = ("gpt2", "bert", "llama", "nanogpt", "lstm")


def compiled_copy(model, backend: str, cache_dir: str = "", copy_model: bool = True):
    """``backend`` is a torch.compile backend name, "eager", "ort_keep" (ort with
    memory_opt_level=0: every activation autograd saves is kept), "ort_recompute" (level 1,
    ort's default since 2026-11-24) or "ort_math_attention" (ort with ``cuda_torch_attention=False``:
    on CUDA, attention written out on ORT instead of PyTorch's fused kernels; on CPU the same as ort)
    or "ort_unfused" (ort with ``pointwise_kernels=False``: every elementwise op ORT's own kernel)
    or "ort_arena" (ort with ``cuda_allocator="shared_arena"``: on CUDA, ORT's own arena beside
    PyTorch's pool instead of PyTorch's allocator; on CPU the same as ort) or "ort_whole_backward"
    (ort with ``backward_segments=1``: each backward partition one ORT run, fewer runs per step;
    the default on CUDA) or "ort_segmented" (``backward_segments=8``, the CPU's default for a
    backward that reads 64 MB or more) or "ort_torch_attention" (ort with ``cpu_torch_attention=True``: on CPU, PyTorch's flash
    attention inside the ORT session; on CUDA the same as ort) or "ort_written_attention" (ort with
    ``cpu_attention_kernel=False``: on CPU, attention as ORT's products and softmax kernels instead
    of ort_dynamo's attention kernels; on CUDA the same as ort) or "ort_mlas" / "ort_torch_blas" (ort
    with ``cpu_matmul="ort"`` / ``"torch_blas"``: on CPU, float32 products by ORT's MLAS (and
    ort_dynamo's own) / by torch's BLAS, whatever "auto" picks here; on CUDA the same as ort) or
    "ort_threads" / "ort_torch_threads" (ort with ``cpu_thread_pool="ort"`` / ``"torch"``: on CPU,
    sessions on ORT's threads / on PyTorch's OpenMP threads, whatever "auto" picks; on CUDA the same as ort).
    ``copy_model=False`` compiles ``model`` itself."""
    clone = copy.deepcopy(model) if copy_model else model
    if backend == "eager":
        return clone, clone
    options = {}
    if backend in ORT_VARIANTS:
        backend, options = "ort", dict(ORT_VARIANTS[backend])
    if backend == "ort" and cache_dir:
        options["cache_dir"] = cache_dir
    kwargs = {"options": options} if options else {}
    return clone, torch.compile(clone, backend=backend, **kwargs)


def make_optimizer(backend: str, model, args):
    """AdamW, the same hyper-parameters everywhere. ``--optimizer adamw``: torch's default
    implementation for every backend (a loop over the parameters on CPU). ``fastest``: the
    fastest each backend has: ``fused=True`` for eager, inductor and aot_eager; ort_dynamo's
    FusedAdam (torch's AdamW update, one ORT run for all parameters) for ort."""
    hyper = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    if args.optimizer == "adamw":
        return torch.optim.AdamW(model.parameters(), **hyper)
    if backend.startswith("ort"):
        from ort_dynamo.optim import AdamWMode, FusedAdam

        return FusedAdam(model.parameters(), adam_w_mode=AdamWMode.ADAMW_TORCH, **hyper)
    return torch.optim.AdamW(model.parameters(), fused=True, **hyper)


def train_step(fn, opt, batch, device, autocast, losses: list | None = None, wait_phases: bool = False):
    """One step; its seconds. ``losses``: the step's loss is appended (a tensor: no wait).
    ``wait_phases``: on CUDA, also wait for the device after forward and backward, as
    ``profile_step.py``'s phase times do."""
    start = time.perf_counter()
    with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
        loss = fn(**batch).loss
    if losses is not None:
        losses.append(loss.detach())
    if wait_phases and device == "cuda":
        torch.cuda.synchronize()
    loss.backward()
    if wait_phases and device == "cuda":
        torch.cuda.synchronize()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def bench_model(name, args) -> dict:
    if args.cache_only:
        return {"model": name, "warm_cache": warm_cache_first_step(name, args)}
    ort_dynamo.reset()
    model, batch = build(name, args.device)
    autocast = args.autocast
    runners = {}
    for backend in args.backends:
        clone, fn = compiled_copy(model, backend)
        runners[backend] = (fn, make_optimizer(backend, clone, args))
    first, times, losses = {}, {b: [] for b in runners}, {b: [] for b in runners}
    # CUDA: the device allocations (cudaMalloc, which synchronizes) each backend's timed steps
    # made: a steady step makes none; one that does waits for the device.
    mallocs = collections.Counter()
    for step in range(args.warmup + args.steps):
        if step == max(args.warmup, 1):
            ort_dynamo.wait_for_kernels()  # steady state: the background compiler is done
        # Each step in another order: in a fixed one, of two identical ort copies the later ran
        # 1-2% faster (docs/performance-log.md, "Rotated order").
        order = list(runners.items())
        order = order[step % len(order):] + order[:step % len(order)]
        for backend, (fn, opt) in order:
            # --block: consecutive steps of one backend, as a training loop runs them; the first
            # of a block follows another backend's step (its idle OpenMP threads may still spin)
            # and is not timed.
            for in_block in range(args.block):
                before = _device_allocs(args.device)
                seconds = train_step(fn, opt, batch, args.device, autocast, losses[backend], args.wait_phases)
                if step == 0 and in_block == 0:
                    first[backend] = seconds
                elif step >= args.warmup and (in_block > 0 or args.block == 1):
                    times[backend].append(seconds)
                    mallocs[backend] += _device_allocs(args.device) - before
    result = {"model": name, "ms": {b: statistics.median(t) * 1e3 for b, t in times.items()},
              "step_ratio_quartiles": step_ratio_quartiles(times),
              "device_allocs": dict(mallocs) if args.device == "cuda" else {},
              "first_s": first, "fallback_nodes": ort_dynamo.report().fallback_nodes,
              # Each backend trains its own copy on the same batch: the losses should stay together.
              "last_loss": {b: float(l[-1]) for b, l in losses.items()}}
    if args.memory:
        cold = {b: peak_memory_mb(name, b, args) for b in args.backends}
        result["peak_mb"] = {b: peak for b, (peak, _) in cold.items()}
        result["compile_call_mb"] = {b: call for b, (_, call) in cold.items() if call is not None}
        if not args.memory_cold_only:
            result["peak_mb_warm"] = {b: peak_memory_mb(name, b, args, warm=True)[0] for b in args.backends}
    if args.cache:
        result["warm_cache"] = warm_cache_first_step(name, args)
    return result


def step_ratio_quartiles(times: dict) -> dict:
    """{"ort/eager": (first quartile, third quartile), ...} of the ratios step by step: the backends'
    steps of one round run back to back, so each step's ratio sees the same moment of a shared
    VM, and their spread shows how far the median ratio can be trusted. Needs 4 steps or more."""
    quartiles = {}
    for base in ("eager", "inductor"):
        if "ort" in times and base in times and len(times["ort"]) >= 4:
            ratios = [o / b for o, b in zip(times["ort"], times[base])]
            q1, _, q3 = statistics.quantiles(ratios, n=4)
            quartiles[f"ort/{base}"] = (q1, q3)
    return quartiles


def _device_allocs(device: str) -> float:
    """cudaMalloc calls PyTorch's caching allocator has made so far (ORT's allocations included,
    with ``cuda_allocator="pytorch"``); 0 off CUDA, NaN where this torch does not count them (so
    no count reads as "none made")."""
    if device != "cuda":
        return 0
    return torch.cuda.memory_stats().get("num_device_alloc", float("nan"))


def peak_memory_mb(name, backend, args, warm: bool = False) -> tuple[float, float | None]:
    """Peak memory of a few training steps in a fresh child process. CPU: peak RSS of steps 2-4
    minus the RSS before the first step, so imports and weights cancel out but memory held
    since the first step, such as allocator arenas, counts. CUDA: the device's memory in use
    after steps 2-4 minus before the first step; PyTorch's caching allocator and ORT's arena
    both keep what they reserved, so that is their peak (PyTorch's cache is emptied after the
    first step, so blocks only compiling used do not count). ``torch.cuda.max_memory_allocated``
    would not see ORT's arena, where ORT's tensors live.
    ``warm``: the backend first trains a tiny other model, so its one-time costs (lazy
    imports, ONNX registry, ORT's environment) are not counted, only this model's.
    Returns the peak and, on CPU, the MB the ``torch.compile()`` call itself took before the
    base (Inductor loads its modules there; Dynamo loads the other backends', Inductor's among
    them, at the first compile, so for ort and aot_eager they fall in the first step and
    count); None on CUDA."""
    out = subprocess.run([sys.executable, __file__, "--child-memory", name, backend, "--device", args.device,
                          "--optimizer", args.optimizer, *(["--autocast"] if args.autocast else [])]
                         + (["--warm-backend"] if warm else []), capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    peak, *compile_call = (float(v) for v in out.stdout.strip().splitlines()[-1].split())
    return peak, (compile_call[0] if compile_call else None)


def warm_backend(backend: str, device: str) -> None:
    """Train a tiny other model with ``backend``, so that its one-time costs (lazy imports,
    ONNX registry, ORT's environment) come before a measurement, not in it."""
    if backend == "eager":
        return
    tiny = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.LayerNorm(8)).to(device)
    _, fn = compiled_copy(tiny, backend)
    fn(torch.randn(2, 8, device=device, requires_grad=True)).sum().backward()


def _child_memory(name, backend, args, at=None) -> None:
    """Prints the peak RSS MB of steps 2-4 over the RSS before the first step, and what
    ``torch.compile()`` took before it. ``at``, if given, is called with "base" when the base is
    read and with "end" after the steps (first_memory.py's split of the growth by mapping)."""
    if args.warm_backend:
        warm_backend(backend, args.device)
    model, batch = build(name, args.device)
    clone = copy.deepcopy(model)
    del model
    before_compile = _rss_mb()
    clone, fn = compiled_copy(clone, backend, copy_model=False)
    compile_call = _rss_mb() - before_compile  # what torch.compile() itself took: Inductor imports there
    opt = make_optimizer(backend, clone, args)
    if args.device == "cuda":
        base = _device_used_mb()
        train_step(fn, opt, batch, "cuda", True)
        torch.cuda.empty_cache()
        for _ in range(3):
            train_step(fn, opt, batch, "cuda", True)
        print(_device_used_mb() - base)
        return
    # Base before the first step, so memory an allocator keeps from then on (ORT's arenas,
    # AdamW state) counts; the peak is reset after it, so compile-time transients do not.
    base = _rss_mb()
    if at is not None:
        at("base")
    train_step(fn, opt, batch, "cpu", args.autocast)
    ort_dynamo.wait_for_kernels()
    _reset_peak_rss()
    for _ in range(3):
        train_step(fn, opt, batch, "cpu", args.autocast)
    peak = _peak_rss_mb() - base
    if at is not None:
        at("end")
    print(peak, compile_call)


def _device_used_mb() -> float:
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2**20


def _rss_mb() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as fh:  # resets VmHWM to the current RSS
        fh.write("5")


def _peak_rss_mb() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def warm_cache_first_step(name, args) -> dict:
    """First-step seconds, each in its own fresh process so no backend inherits another's
    one-time start-up: aot_eager; ort with an empty cache (which fills it); ort again with
    that warm cache. ``--first-step-rounds`` rounds of the three, each with a new cache: one
    process's first step moves by 10% on a shared VM, so the ratios are taken per round
    (the processes of a round run back to back) and their median reported."""
    rounds = []
    for number in range(1, args.first_step_rounds + 1):
        with tempfile.TemporaryDirectory() as cache:
            rounds.append({})
            for label, backend in (("aot_eager", "aot_eager"), ("cold", "ort"), ("warm", "ort")):
                rounds[-1][label] = result = _first_step_in_new_process(name, backend, cache, args)
                # As each process ends: a run stopped at a time limit still says what it measured.
                print(f"{name:10s} round {number}, new process, {label}: first step {result['seconds']:.1f}s, "
                      f"exports {result['exports']}", flush=True)
    summary = {"rounds": rounds, "exports_warm": max(r["warm"]["exports"] for r in rounds)}
    for label in ("aot_eager", "cold", "warm"):
        summary[label + "_s"] = statistics.median(r[label]["seconds"] for r in rounds)
    for label in ("cold", "warm"):
        ratios = sorted(r[label]["seconds"] / r["aot_eager"]["seconds"] for r in rounds)
        summary[label + "_ratio"] = statistics.median(ratios)
        summary[label + "_ratios"] = ratios
    return summary


def _first_step_in_new_process(name, backend, cache, args) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child-first-step", name, backend, cache,
                          "--device", args.device, "--optimizer", args.optimizer,
                          *(["--autocast"] if args.autocast else [])],
                         capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def _child_first_step(name, backend, cache_dir, args) -> None:
    model, batch = build(name, args.device)
    clone, fn = compiled_copy(model, backend, cache_dir)
    opt = make_optimizer(backend, clone, args)
    seconds = train_step(fn, opt, batch, args.device, args.autocast)
    print(json.dumps({"seconds": seconds, "exports": ort_dynamo.report().exports}))


def interleaved_ms(function, inputs, steps: int, loss=lambda out: out,
                   dynamic: bool = False, variant: dict | None = None) -> tuple[float, ...]:
    """Median ms of ``loss(function(*inputs)).backward()`` in eager and with ``function``
    compiled on ORT (with ``dynamic=True`` where ``dynamic``), steps interleaved, after three
    warm-up steps and the kernels' build; and the seconds of ORT's first step (compile
    included; the kernels build in the background). With ``variant`` (ORT options), a fourth
    figure: the median ms of a second compiled copy with those options, interleaved too."""
    def step(fn) -> float:
        start = time.perf_counter()
        loss(fn(*inputs)).backward()
        return time.perf_counter() - start

    ort_dynamo.reset()
    torch._dynamo.reset()
    compiled = torch.compile(function, backend="ort", dynamic=dynamic or None)
    first = step(compiled)
    fns = [function, compiled]
    if variant is not None:
        fns.append(torch.compile(function, backend="ort", dynamic=dynamic or None, options=variant))
        step(fns[-1])
    for _ in range(3):
        for fn in fns:
            step(fn)
    ort_dynamo.wait_for_kernels()
    times = [[] for _ in fns]
    for _ in range(steps):
        for fn, record in zip(fns, times):
            record.append(step(fn))
    medians = [statistics.median(record) * 1e3 for record in times]
    return (medians[0], medians[1], first, *medians[2:])


def _steady_malloc() -> bool:
    """Large blocks from the heap, kept after free, whatever the other backends freed before
    (glibc only; see the module's doc)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's mallopt parameters
    return bool(libc.mallopt(m_mmap_threshold, 32 << 20)) and bool(libc.mallopt(m_trim_threshold, 1 << 30))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="gpt2,bert,llama")
    parser.add_argument("--backends", default="eager,inductor,ort,aot_eager",
                        help="comma-separated: eager, inductor, aot_eager, ort, " + ", ".join(ORT_VARIANTS))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--block", type=int, default=1,
                        help="steps of one backend in a row (default 1: steps interleaved one by one); from 2, "
                             "the first of each block is not timed (see the OpenMP note above)")
    parser.add_argument("--memory", action="store_true")
    parser.add_argument("--memory-cold-only", action="store_true",
                        help="with --memory: skip the second measurement, after a warm-up on another model "
                             "(half the child processes; for a GPU session's short time)")
    parser.add_argument("--cache", action="store_true")
    parser.add_argument("--cache-only", action="store_true",
                        help="only --cache's fresh-process first steps, no steady-state steps")
    parser.add_argument("--first-step-rounds", type=int, default=3,
                        help="with --cache: rounds of fresh-process first steps (aot_eager, ort cold, ort "
                             "warm); the ratios printed are the rounds' medians")
    parser.add_argument("--optimizer", choices=["adamw", "fastest"], default="adamw",
                        help="adamw: torch.optim.AdamW for all; fastest: each backend's fastest AdamW "
                             "(torch fused=True; ort: ort_dynamo FusedAdam)")
    parser.add_argument("--autocast", action="store_true",
                        help="train under torch.autocast(bfloat16) on CPU too (on CUDA always)")
    parser.add_argument("--wait-phases", action="store_true",
                        help="CUDA: wait for the device after each step's forward and backward too")
    parser.add_argument("--json", help="also write results here")
    parser.add_argument("--malloc", choices=["steady", "default"], default="steady",
                        help="steady: fix glibc's mmap and trim thresholds in the timing process (see above)")
    parser.add_argument("--child-memory", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--warm-backend", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child-first-step", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.backends = args.backends.split(",")
    args.cache = args.cache or args.cache_only
    args.autocast = args.autocast or args.device == "cuda"
    if args.block < 1:
        parser.error(f"--block must be at least 1 step, got {args.block}")
    if args.first_step_rounds < 1:
        parser.error(f"--first-step-rounds must be at least 1, got {args.first_step_rounds}")
    if args.wait_phases and args.device != "cuda":
        parser.error("--wait-phases times CUDA steps (a CPU step has no device to wait for); add --device cuda")
    if args.child_memory:
        return _child_memory(*args.child_memory, args)
    if args.child_first_step:
        return _child_first_step(*args.child_first_step, args)

    steady = args.malloc == "steady" and _steady_malloc()
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu"
    print(f"device: {args.device} ({device_name}), {os.cpu_count()} cores, torch {torch.__version__}, "
          f"malloc thresholds {'fixed' if steady else 'glibc default'}, optimizer {args.optimizer}, "
          f"OMP_WAIT_POLICY {os.environ.get('OMP_WAIT_POLICY', 'unset')}"
          f"{f', blocks of {args.block} steps' if args.block > 1 else ''}"
          f"{', bfloat16 autocast' if args.autocast else ''}")
    print(f"command: {' '.join([os.path.basename(sys.executable)] + sys.argv)}")
    results = []
    for name in args.models.split(","):
        r = bench_model(name, args)
        results.append(r)
        if "ms" in r:
            print_steps(name, r, args)
        if "warm_cache" in r:
            w = r["warm_cache"]
            ranges = {label: "" if len(w[label + "_ratios"]) == 1 else
                      f", {len(w[label + '_ratios'])} rounds {' '.join(f'{x:.2f}' for x in w[label + '_ratios'])}"
                      for label in ("cold", "warm")}
            print(f"{name if 'ms' not in r else '':10s} first step, each in a new process: aot_eager {w['aot_eager_s']:.1f}s, ort {w['cold_s']:.1f}s"
                  f" (ort/aot_eager {w['cold_ratio']:.2f}{ranges['cold']}), ort with warm cache {w['warm_s']:.1f}s"
                  f" (ort/aot_eager {w['warm_ratio']:.2f}{ranges['warm']}, exports {w['exports_warm']})")
        sys.stdout.flush()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2)


def print_steps(name, r, args) -> None:
    ms = r["ms"]
    line = f"{name:10s} " + " ".join(f"{b} {ms[b]:8.1f} ms" for b in args.backends)
    if "eager" in ms and "ort" in ms:
        line += f" | ort/eager {ms['ort'] / ms['eager']:.2f}"
    if "inductor" in ms and "ort" in ms:
        line += f" ort/inductor {ms['ort'] / ms['inductor']:.2f}"
    print(line)
    spread = r.get("step_ratio_quartiles")
    if spread:
        print(f"{'':10s} step by step, quartiles: "
              + " ".join(f"{pair} {q1:.2f}-{q3:.2f}" for pair, (q1, q3) in spread.items()))
    f = r["first_s"]
    print(f"{'':10s} first step: " + " ".join(f"{b} {f[b]:.1f}s" for b in args.backends)
          + (f" | ort/aot_eager {f['ort'] / f['aot_eager']:.2f}" if "aot_eager" in f and "ort" in f else "")
          + f" | ort fallback nodes {r['fallback_nodes']}")
    print(f"{'':10s} loss at the last step: " + " ".join(f"{b} {v:.4f}" for b, v in r["last_loss"].items()))
    if r["device_allocs"]:
        print(f"{'':10s} cudaMalloc calls in the timed steps: "
              + " ".join(f"{b} {n:.0f}" for b, n in r["device_allocs"].items()))
    if "peak_mb" in r:
        p = r["peak_mb"]
        w = r.get("peak_mb_warm")
        print(f"{'':10s} peak step memory MB: " + " ".join(f"{b} {p[b]:.0f}" for b in args.backends)
              + (" | backend warmed on another model first: " + " ".join(f"{b} {w[b]:.0f}" for b in args.backends)
                 if w else ""))
        c = r.get("compile_call_mb")
        if c:
            print(f"{'':10s} MB the torch.compile() call took before the first step (not counted above): "
                  + " ".join(f"{b} {c[b]:.0f}" for b in args.backends if b in c))


if __name__ == "__main__":
    main()
