#!/usr/bin/env bash
# The GPU checks of docs/performance-log.md "GPU", as one call on the lent GPU machine, in the
# order they matter: environment; the CUDA tests; training parity of a compiled copy alone in
# its process and of a second copy beside another (second copies went wrong on an H100 on
# 2026-11-26, right on an H200 on 2026-11-27 with ORT on PyTorch's stream);
# the GPU memory each ORT session holds beyond PyTorch's pool (and with cuBLAS's workspace
# made 4 MiB); the training-step benchmark
# (GPT-2 124M, bf16 autocast; ort with and without ORT's memory pattern, option
# cuda_memory_pattern); the eager/ort pair alone, then with a device wait after each phase; peak
# memory (ort with and without the pattern); where ORT placed GPT-2's nodes and each
# backend's GPU kernel times; whether the host runs ahead of the GPU; then the first step with a
# cold and a warm on-disk cache (fresh processes, each printed as it ends) and per-call
# overhead. About 14 minutes in all: a 560 s budget leaves out the last ones.
# Each step has its own time limit inside one budget, so a slow or hung step still leaves the
# others' results.
#
#   bash tools/gpu_check.sh [budget-seconds [step...]]   # default 560, all steps; from the repository root
#   bash tools/gpu_check.sh 250 cuda-tests host-ahead train-step   # only these (a second, shorter call)
#
# Needs onnxruntime-gpu installed into /tmp/ortsite (../shared/device/README.md, steps 1-3).
# Writes summary.txt (each step's tail) and logs.tgz (each step's whole log, packed after each
# step: the device tool brings back at most 8 files) to $OUT, or ./gpu-check.
set -u
out="${OUT:-gpu-check}"
mkdir -p "$out/logs"
budget="${1:-560}"
only=" ${*:2} "
site=/tmp/ortsite
export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
summary="$out/summary.txt"

say() { echo "$*" | tee -a "$summary"; }

# step NAME MAX_SECONDS COMMAND...: runs COMMAND for at most MAX_SECONDS (less if the budget
# has less left), its output in $out/NAME.txt, the tail of it in the summary.
step() {
  local name=$1 limit=$2
  shift 2
  [[ "$only" == "  " || "$only" == *" $name "* ]] || return 0
  local left=$((budget - SECONDS))
  ((left < limit)) && limit=$left
  if ((limit < 30)); then
    say "== $name: not run, ${left}s of the ${budget}s budget left"
    return
  fi
  say "== $name (limit ${limit}s): $*"
  local began=$SECONDS
  timeout -k 10 "$limit" "$@" >"$out/logs/$name.txt" 2>&1
  local rc=$?
  tail -n 25 "$out/logs/$name.txt" | tee -a "$summary"
  say "== $name: exit $rc in $((SECONDS - began))s$([ $rc -ge 124 ] && echo ' (time limit)')"
  tar czf "$out/logs.tgz" -C "$out" logs
}

say "== $(date -u +%FT%TZ) commit $(git rev-parse --short HEAD 2>/dev/null || echo '?') $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null)"
if ! python3 -c "import torch, onnxruntime as o, sys; sys.exit(not (torch.cuda.is_available() and 'CUDAExecutionProvider' in o.get_available_providers()))"; then
  say "no usable GPU: torch.cuda.is_available() is False or onnxruntime (from $site first) lacks the CUDA provider"
  python3 -c "import torch, onnxruntime as o; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), '| onnxruntime', o.__version__, o.__file__, o.get_available_providers())" 2>&1 | tee -a "$summary"
  exit 2
fi
# backend="ort" by its entry point, as for an installed package (this checkout is only on PYTHONPATH).
mkdir -p "$site/ort_dynamo_checkout-0.dist-info"
printf 'Metadata-Version: 2.1\nName: ort_dynamo_checkout\nVersion: 0\n' >"$site/ort_dynamo_checkout-0.dist-info/METADATA"
printf '[torch_dynamo_backends]\nort = ort_dynamo.capture:ort_backend\n' >"$site/ort_dynamo_checkout-0.dist-info/entry_points.txt"

step info 45 python3 -m ort_dynamo info
step cuda-tests 200 python3 -m pytest -q -p no:cacheprovider -m cuda tests -rs
step parity 200 python3 benchmarks/gpu_parity.py --steps 6 'alone={}' 'second_copy={"_second": true, "_check": true}' \
  'second_copy_per_session={"_second": {"cuda_allocator": "per_session"}, "cuda_allocator": "per_session"}'
step session-memory 60 python3 benchmarks/session_memory.py --sessions 16
step session-memory-cublas-4mb 60 env CUBLAS_WORKSPACE_CONFIG=:4096:1 python3 benchmarks/session_memory.py --sessions 16
step train-step 240 python3 benchmarks/train_step.py --device cuda --models gpt2-124m \
  --backends eager,inductor,ort,ort_mem_pattern,aot_eager --steps 20 --warmup 3
# eager and ort alone in a process: with other compiled copies beside it, each compiled step also
# pays Dynamo's failed guard checks of the others (docs/performance-log.md, 2026-11-28).
step train-step-pair 120 python3 benchmarks/train_step.py --device cuda --models gpt2-124m \
  --backends eager,ort --steps 20 --warmup 3
# The same pair, waiting for the device after forward and backward too: profile_step.py's phase
# times (sequential, with those waits) had ort at 0.90 of eager where the pair had 1.19
# (docs/performance-log.md, "ORT's memory pattern off on CUDA").
step phase-waits 120 python3 benchmarks/train_step.py --device cuda --models gpt2-124m \
  --backends eager,ort --steps 20 --warmup 3 --wait-phases
step memory 200 python3 benchmarks/train_step.py --device cuda --models gpt2-124m \
  --backends eager,ort,ort_mem_pattern --steps 5 --warmup 2 --memory --memory-cold-only
step placement 200 python3 benchmarks/profile_step.py --device cuda --model gpt2-124m --steps 3
step host-ahead 60 python3 benchmarks/host_ahead.py
step first-step-cache 240 python3 benchmarks/train_step.py --device cuda --models gpt2-124m --cache-only \
  --first-step-rounds 1
step call-overhead 45 python3 benchmarks/call_overhead.py --device cuda --calls 500
say "== done in ${SECONDS}s"
rm -rf "$out/logs"
