#!/usr/bin/env bash
# The serving-engine benchmarks of docs/benchmarks.md (issue 3) and the CPU-speed baselines
# (issue 6), each with `tessera bench`. Writes JSON and HTML reports to OUT (default
# build/bench-results). Run on a quiet machine; ratios are only meaningful within one run.
#   bench/run-engine-benchmarks.sh [OUT] [ROUNDS]
set -euo pipefail
src="$(cd "$(dirname "$0")/.." && pwd)"
bin="${TESSERA_BIN:-$src/build/bin/tessera}"
out="${1:-$src/build/bench-results}"
rounds="${2:-3}"
mkdir -p "$out"
cfg="$src/configs/bench"
run() { echo "+ $*" >&2; "$@"; }

# Batch-1 latency against this machine's limits, and the decode roofline.
run "$bin" bench latency -c "$src/configs/smollm2-cpu.yaml" -p 512 -g 128 -r 3 \
  --json "$out/latency.json" --html "$out/latency.html"
run "$bin" bench roofline -c "$cfg/roofline.yaml" --max-batch 64 --steps 8 \
  --json "$out/roofline.json" --html "$out/roofline.html"

# Paged vs contiguous at one 192 MiB KV budget, mixed lengths, all requests at t = 0.
run "$bin" bench ab "$cfg/kv-paged.yaml" "$cfg/kv-contiguous.yaml" --make mixed -n 32 -r "$rounds" \
  --json "$out/kv-paged-vs-contiguous.json" --html "$out/kv-paged-vs-contiguous.html"

# Prefix caching: a 500-token system prompt shared by 8 requests, one every 5 s (longer than
# a 560-token prefill on a quiet machine, so TTFT is not queueing).
run "$bin" bench ab "$cfg/prefix-on.yaml" "$cfg/prefix-off.yaml" --make shared-prefix -n 8 --interval 5 -r "$rounds" \
  --json "$out/prefix-on-vs-off.json" --html "$out/prefix-on-vs-off.html"

# Continuous vs static batching, outputs 16-256 tokens, max 8 sequences each.
run "$bin" bench ab "$cfg/batching-continuous.yaml" "$cfg/batching-static.yaml" --make uniform-output -n 24 -r "$rounds" \
  --json "$out/continuous-vs-static.json" --html "$out/continuous-vs-static.html"

# Chunked prefill: 8 sequences decode while 1000-1200-token prompts arrive every 2 s.
run "$bin" bench ab "$cfg/chunked-on.yaml" "$cfg/chunked-off.yaml" --make long-prompt-interference -n 11 -r "$rounds" \
  --json "$out/chunked-on-vs-off.json" --html "$out/chunked-on-vs-off.html"

# Flash vs naive attention at 2,048 tokens of context.
run "$src/build/bench/bench_attention" | tee "$out/attention.txt"
