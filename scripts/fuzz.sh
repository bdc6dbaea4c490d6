#!/usr/bin/env bash
# Runs the libFuzzer targets of tests/fuzz (clang, ASan + UBSan).
#
#   scripts/fuzz.sh [TARGET|all] [SECONDS]    e.g. scripts/fuzz.sh gguf 1800
#
# TARGET is a tests/fuzz/fuzz_<TARGET>.cpp (gguf, config, tokenizer, chat_template, openai,
# http); all runs each in turn for SECONDS (default 60). The committed corpus/<TARGET>/ seeds
# start each run; inputs the fuzzer finds interesting go to ${build}/corpus/<TARGET>/ (not
# committed); a crash, leak or timeout is written to tests/fuzz/corpus/<TARGET>/regression-*
# so that the test suite replays it from then on (fix it, then commit the file). Prints each
# target's executions and exits non-zero if any target failed.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
which=${1:-all}
seconds=${2:-60}
build=${TESSERA_FUZZ_BUILD_DIR:-$root/build-fuzz}
jobs=${TESSERA_JOBS:-$(nproc)}
command -v clang++ >/dev/null || apt-get install -y --no-install-recommends clang libclang-rt-dev

targets=()
if [[ $which == all ]]; then
  for f in "$root"/tests/fuzz/fuzz_*.cpp; do
    t=$(basename "$f" .cpp); targets+=("${t#fuzz_}")
  done
else
  [[ -f $root/tests/fuzz/fuzz_$which.cpp ]] || { echo "fuzz: no tests/fuzz/fuzz_$which.cpp" >&2; exit 2; }
  targets=("$which")
fi

# TESSERA_FUZZ_SKIP_BUILD=1 runs what is built (for several runs in parallel on one build).
if [[ ${TESSERA_FUZZ_SKIP_BUILD:-0} != 1 ]]; then
  CC=clang CXX=clang++ cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DTESSERA_FUZZ=ON -DTESSERA_SANITIZE=address,undefined -DTESSERA_ENABLE_CUDA=OFF >/dev/null
  # The config target validates against the real plugins' schemas, so build those too.
  plugins=$(ninja -C "$build" -t targets all | sed -n 's|^\(plugins/libtessera-[^:]*\.so\):.*|\1|p')
  cmake --build "$build" -j "$jobs" --target $(printf 'fuzz_%s ' "${targets[@]}") -- $plugins
fi

export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
export TESSERA_SHARED_DIR=${TESSERA_SHARED_DIR:-$root/../shared}
# A unit slower than this (wall clock) counts as a hang. 20 s is ~50x the slowest seed's CPU
# time (the 100,000-node config alias bomb: 0.4 s under ASan); on a loaded machine at nice 19
# that is not enough, so TESSERA_FUZZ_UNIT_TIMEOUT raises it.
unit_timeout=${TESSERA_FUZZ_UNIT_TIMEOUT:-20}
failed=0
for t in "${targets[@]}"; do
  work="$build/corpus/$t"
  mkdir -p "$work"
  log="$build/fuzz-$t.log"
  echo "fuzz: $t for ${seconds}s (log: $log)"
  if "$build/tests/fuzz/fuzz_$t" -max_total_time="$seconds" -timeout="$unit_timeout" -rss_limit_mb=3072 \
       -max_len=65536 -print_final_stats=1 -report_slow_units=60 \
       -artifact_prefix="$root/tests/fuzz/corpus/$t/regression-" \
       "$work" "$root/tests/fuzz/corpus/$t" >"$log" 2>&1; then
    echo "fuzz: $t ok: $(grep -E '^(Done|stat::number_of_executed_units)' "$log" | tr '\n' ' ')"
  else
    echo "fuzz: $t FAILED, see $log; the input is in tests/fuzz/corpus/$t/regression-*"
    tail -30 "$log"
    failed=1
  fi
done
exit $failed
