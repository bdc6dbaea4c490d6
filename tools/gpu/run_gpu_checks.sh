#!/usr/bin/env bash
# The CUDA checks of issue 5, in one run on a lent GPU machine (H200, 16 cores, no network).
#
#   here:    tools/gpu/pack_prebuilt.sh            (only if the GPU image lacks the C++ deps;
#                                                   the H200 image has no Boost/yaml-cpp/spdlog)
#   device:  run(command="bash tools/gpu/run_gpu_checks.sh", carry=[".gpu-prebuilt"],
#                timeout_s=600)
#
# Steps (each with its own limit, all inside a global budget of TESSERA_GPU_BUDGET_S seconds,
# default 560, so the run fits the 10-minute command limit):
#   1. binaries: the carried .gpu-prebuilt/ when present (and its COMMIT matches HEAD, else a
#      warning), otherwise configure + build only the CUDA targets and the plugins they load
#      (-DCMAKE_CUDA_ARCHITECTURES=90, all cores);
#   2. cuda_kernels: every kernel against the CPU backend / double references, cuda-flash,
#      device sampling, the GEMM path, greedy generation on the synthetic SmolLM2-shaped model
#      equal to the CPU backend, and the engine with backend: cuda equal to the CPU engine;
#   3. kernels against PyTorch (bench_cuda --dump + tools/gpu/torch_kernel_check.py);
#   4. bench_cuda: Llama-3-8B-shaped bf16 benchmark (roofline, batch 64/256, prefill 2048,
#      compute-bound batch);
#   5. bench/hf_compare.py: transformers generate at batch 64 on the same shapes.
# Results: at most 8 files in $OUT (the device tool returns no more): summary.json, logs.txt,
# test_cuda.log, bench_cuda.json, hf_compare.json, torch_check.json.
set -u
cd "$(dirname "$0")/../.."
ROOT=$PWD
OUT=${OUT:-$ROOT/gpu-results}
WORK=${TESSERA_GPU_WORK:-/tmp/tessera-gpu}
mkdir -p "$OUT" "$WORK"
BUDGET=${TESSERA_GPU_BUDGET_S:-560}
START=$(date +%s)
JOBS=$(nproc 2>/dev/null || echo 8)
STEPS=$WORK/steps.jsonl
: > "$STEPS"
export PYTHONUNBUFFERED=1

remaining() { echo $(( BUDGET - ($(date +%s) - START) )); }

# step NAME LIMIT_S CMD... : runs with min(LIMIT_S, remaining - 5) s, logs to $WORK/NAME.log
step() {
  local name=$1 limit=$2
  shift 2
  local left
  left=$(( $(remaining) - 5 ))
  if (( left < 10 )); then
    echo "{\"step\":\"$name\",\"rc\":null,\"skipped\":\"out of time\"}" >> "$STEPS"
    echo "== $name: skipped (out of time)"
    return 124
  fi
  (( limit > left )) && limit=$left
  echo "== $name (limit ${limit}s, $(remaining)s left)"
  local t0 rc
  t0=$(date +%s)
  timeout --kill-after=5 "$limit" "$@" > "$WORK/$name.log" 2>&1
  rc=$?
  echo "{\"step\":\"$name\",\"rc\":$rc,\"seconds\":$(( $(date +%s) - t0 )),\"limit\":$limit}" >> "$STEPS"
  tail -n 12 "$WORK/$name.log"
  echo "== $name: rc=$rc"
  return $rc
}

{
  date -u
  nvidia-smi || true
  nvcc --version | tail -2 || true
  cmake --version | head -1 || true
  python3 -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__)' || true
  git -C "$ROOT" log --oneline -1 2>/dev/null || true
} > "$WORK/environment.log" 2>&1
cat "$WORK/environment.log"

# cuBLAS/cudart of the machine's CUDA 13 (toolkit or the pip wheels PyTorch uses).
CUDA_LIBS=$(ls -d /usr/local/cuda/lib64 /usr/local/cuda/lib /usr/local/cuda/targets/x86_64-linux/lib 2>/dev/null | tr '\n' ':')
CUDA_LIBS+=$(python3 - 2>/dev/null <<'EOF'
import glob, os, site
dirs = set()
for sp in site.getsitepackages():
    for lib in glob.glob(os.path.join(sp, "nvidia", "*", "lib")) + glob.glob(os.path.join(sp, "nvidia", "cu13", "lib")):
        dirs.add(lib)
print(":".join(sorted(dirs)))
EOF
)

PREBUILT=$ROOT/.gpu-prebuilt
built=0
if [[ -d $PREBUILT && -z ${TESSERA_GPU_FORCE_BUILD:-} ]]; then
  echo "== using carried binaries in .gpu-prebuilt (commit $(cat "$PREBUILT/COMMIT" 2>/dev/null))"
  if [[ "$(cat "$PREBUILT/COMMIT" 2>/dev/null)" != "$(git -C "$ROOT" rev-parse HEAD 2>/dev/null)" ]]; then
    echo "WARNING: .gpu-prebuilt was built from another commit than HEAD" | tee -a "$WORK/environment.log"
  fi
  BIN_TEST=$PREBUILT/bin/cuda_kernels
  BIN_HOST=$PREBUILT/bin/cuda_host
  BIN_BENCH=$PREBUILT/bin/bench_cuda
  PLUGIN_DIR=$PREBUILT/plugins
  export LD_LIBRARY_PATH=$PREBUILT/lib:${CUDA_LIBS}:${LD_LIBRARY_PATH:-}
  built=1
else
  BUILD=${TESSERA_GPU_BUILD_DIR:-$WORK/build}
  GEN=()
  command -v ninja > /dev/null && GEN=(-G Ninja)
  if step configure 120 cmake -S "$ROOT" -B "$BUILD" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release \
       -DCMAKE_CUDA_ARCHITECTURES=90 -DTESSERA_BUILD_TESTS=ON; then
    step build 300 cmake --build "$BUILD" -j "$JOBS" --target cuda_kernels cuda_host bench_cuda backend-cuda \
      attention-cuda-flash attention-flash quantizer-gguf scheduler-continuous kv_cache-paged sampler-standard \
      && built=1
  fi
  BIN_TEST=$BUILD/tests/cuda/cuda_kernels
  BIN_HOST=$BUILD/tests/cuda/cuda_host
  BIN_BENCH=$BUILD/bench/bench_cuda
  PLUGIN_DIR=$BUILD/plugins
  export LD_LIBRARY_PATH=${CUDA_LIBS}:${LD_LIBRARY_PATH:-}
fi

if (( built )); then
  mkdir -p "$WORK/test-build"
  # 2. kernels, runner and engine vs the CPU backend
  step test_cuda 150 env TESSERA_SOURCE_DIR="$ROOT" TESSERA_BUILD_DIR="$WORK/test-build" \
    TESSERA_PLUGIN_DIR="$PLUGIN_DIR" "$BIN_TEST" --duration=true
  step test_cuda_host 30 env TESSERA_SOURCE_DIR="$ROOT" TESSERA_BUILD_DIR="$WORK/test-build" \
    TESSERA_PLUGIN_DIR="$PLUGIN_DIR" "$BIN_HOST"
  # 3. kernels vs PyTorch
  rm -rf "$WORK/kernel_dumps" && mkdir -p "$WORK/kernel_dumps"
  if step dump_kernels 60 "$BIN_BENCH" --dump "$WORK/kernel_dumps"; then
    step torch_check 90 python3 "$ROOT/tools/gpu/torch_kernel_check.py" "$WORK/kernel_dumps" "$WORK/torch_check.json"
  fi
  rm -rf "$WORK/kernel_dumps"
  # 4. benchmark
  step bench 200 "$BIN_BENCH" --out "$WORK/bench_cuda.json"
fi

# 5. transformers (runs even without Tessera binaries; uses Tessera's numbers when present)
TESSERA_JSON=()
[[ -f "$WORK/bench_cuda.json" ]] && TESSERA_JSON=(--tessera "$WORK/bench_cuda.json")
step hf_compare 180 python3 "$ROOT/bench/hf_compare.py" "${TESSERA_JSON[@]}" --batch 64 --out "$WORK/hf_compare.json"

# At most 8 files back: the JSONs, the test log, every log concatenated, and a summary.
for f in bench_cuda.json hf_compare.json torch_check.json; do
  [[ -f "$WORK/$f" ]] && cp "$WORK/$f" "$OUT/"
done
[[ -f "$WORK/test_cuda.log" ]] && tail -c 4000000 "$WORK/test_cuda.log" > "$OUT/test_cuda.log"
for f in "$WORK"/*.log; do
  echo "=================== $(basename "$f")"
  tail -c 2000000 "$f"
done > "$OUT/logs.txt"
python3 - "$WORK" "$OUT" <<'EOF' || true
import json, os, sys
work, out = sys.argv[1], sys.argv[2]
steps = [json.loads(l) for l in open(os.path.join(work, "steps.jsonl")) if l.strip()]
summary = {"steps": steps}
for name in ("bench_cuda", "hf_compare", "torch_check"):
    p = os.path.join(work, name + ".json")
    if os.path.exists(p):
        try:
            summary[name] = json.load(open(p))
        except ValueError:
            summary[name] = "unreadable"
json.dump(summary, open(os.path.join(out, "summary.json"), "w"), indent=1)
print(json.dumps({s["step"]: s.get("rc") for s in steps}))
EOF
echo "total $(( $(date +%s) - START ))s; results in $OUT"
