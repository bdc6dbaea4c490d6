#!/usr/bin/env bash
# The CUDA checks of issue 5, in one run on a lent GPU machine (H200, 16 cores, no network).
#
#   device tool:  bash tools/gpu/run_gpu_checks.sh        (timeout_s 600)
#
# Steps (each with its own time limit, all inside a global budget of TESSERA_GPU_BUDGET_S
# seconds, default 570, so the whole run fits the 10-minute command limit):
#   1. configure + build only the CUDA targets and the plugins they load (sm_90 only);
#   2. ctest cuda_kernels: every kernel against the CPU backend / double references, cuda-flash,
#      device sampling, GEMM path, and greedy generation on the synthetic SmolLM2-shaped model
#      equal to the CPU backend;
#   3. kernels against PyTorch (bench_cuda --dump + tools/gpu/torch_kernel_check.py);
#   4. bench_cuda: Llama-3-8B-shaped bf16 benchmark (roofline, batch 64/256, prefill 2048,
#      compute-bound batch);
#   5. bench/hf_compare.py: transformers generate at batch 64 on the same shapes.
# Everything lands under $OUT (logs, JSON, summary.json). A failed step does not stop later
# steps unless they need its output (the build).
set -u
cd "$(dirname "$0")/../.."
ROOT=$PWD
OUT=${OUT:-$ROOT/gpu-results}
mkdir -p "$OUT"
BUDGET=${TESSERA_GPU_BUDGET_S:-570}
START=$(date +%s)
BUILD=${TESSERA_GPU_BUILD_DIR:-$ROOT/build-gpu}
JOBS=$(nproc 2>/dev/null || echo 8)
SUMMARY=$OUT/steps.jsonl
: > "$SUMMARY"

remaining() { echo $(( BUDGET - ($(date +%s) - START) )); }

# step NAME LIMIT_S CMD... : runs with min(LIMIT_S, remaining - 5) seconds, logs to $OUT/NAME.log
step() {
  local name=$1 limit=$2
  shift 2
  local left
  left=$(( $(remaining) - 5 ))
  if (( left < 10 )); then
    echo "{\"step\":\"$name\",\"rc\":null,\"skipped\":\"out of time\"}" >> "$SUMMARY"
    echo "== $name: skipped (out of time)"
    return 124
  fi
  (( limit > left )) && limit=$left
  echo "== $name (limit ${limit}s, $(remaining)s left in the budget)"
  local t0 rc
  t0=$(date +%s)
  timeout --kill-after=5 "$limit" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  echo "{\"step\":\"$name\",\"rc\":$rc,\"seconds\":$(( $(date +%s) - t0 )),\"limit\":$limit}" >> "$SUMMARY"
  tail -n 15 "$OUT/$name.log"
  echo "== $name: rc=$rc"
  return $rc
}

{
  date -u
  nvidia-smi || true
  nvcc --version || true
  cmake --version | head -1 || true
  python3 -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__)' || true
  git -C "$ROOT" log --oneline -1 2>/dev/null || true
} > "$OUT/environment.txt" 2>&1
cat "$OUT/environment.txt"

GEN=()
command -v ninja > /dev/null && GEN=(-G Ninja)
step configure 120 cmake -S "$ROOT" -B "$BUILD" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_CUDA_ARCHITECTURES=90 -DTESSERA_BUILD_TESTS=ON
built=0
if step build 300 cmake --build "$BUILD" -j "$JOBS" --target cuda_kernels bench_cuda backend-cuda \
     attention-cuda-flash attention-flash quantizer-gguf scheduler-continuous kv_cache-paged sampler-standard; then
  built=1
fi

if (( built )); then
  # 2. kernels and runner vs the CPU backend; junit report beside the log.
  step test_cuda 150 env TESSERA_SOURCE_DIR="$ROOT" TESSERA_BUILD_DIR="$BUILD" \
    TESSERA_PLUGIN_DIR="$BUILD/plugins" "$BUILD/tests/cuda/cuda_kernels" --duration=true --success=false

  # 3. kernels vs PyTorch
  mkdir -p "$OUT/kernel_dumps"
  if step dump_kernels 60 "$BUILD/bench/bench_cuda" --dump "$OUT/kernel_dumps"; then
    step torch_check 90 python3 "$ROOT/tools/gpu/torch_kernel_check.py" "$OUT/kernel_dumps" "$OUT/torch_check.json"
  fi
  rm -f "$OUT"/kernel_dumps/*.bin  # large; the JSON keeps the errors

  # 4. benchmark
  step bench 200 "$BUILD/bench/bench_cuda" --out "$OUT/bench_cuda.json"
fi

# 5. transformers (independent of the build; uses Tessera's numbers when they exist)
TESSERA_JSON=()
[[ -f "$OUT/bench_cuda.json" ]] && TESSERA_JSON=(--tessera "$OUT/bench_cuda.json")
step hf_compare 180 python3 "$ROOT/bench/hf_compare.py" "${TESSERA_JSON[@]}" --batch 64 --out "$OUT/hf_compare.json"

python3 - "$OUT" <<'EOF' || true
import json, os, sys
out = sys.argv[1]
steps = [json.loads(l) for l in open(os.path.join(out, "steps.jsonl")) if l.strip()]
summary = {"steps": steps}
for name in ("bench_cuda", "hf_compare", "torch_check"):
    p = os.path.join(out, name + ".json")
    if os.path.exists(p):
        try:
            summary[name] = json.load(open(p))
        except ValueError:
            summary[name] = "unreadable"
json.dump(summary, open(os.path.join(out, "summary.json"), "w"), indent=1)
print(json.dumps({s["step"]: s.get("rc") for s in steps}))
EOF
echo "total $(( $(date +%s) - START ))s; results in $OUT"
