#!/usr/bin/env bash
# Sanitizer builds of Tessera and the tests that run under them.
#
#   scripts/sanitize.sh quick   ASan+UBSan: the unit, conformance and protocol suites and the
#                               CLI error cases (12m42s build + 2 min tests with -j2 on 2 idle
#                               cores, ccache partly warm); scripts/test.sh runs it
#   scripts/sanitize.sh asan    ASan+UBSan: every test but the CUDA ones (19.5 min build with
#                               -j2 on a busy 2-vCPU machine; the tests take hours there: the
#                               engine invariance test alone 22 min, docs/benchmarks.md)
#   scripts/sanitize.sh tsan    TSan: the threaded ones (thread pool, engine, server, replicas); builds
#                               only what they run (22 min with -j1 beside another build). The
#                               interleaved x86 matmul kernels are not instrumented, their calls
#                               are checked as ranges (docs/cpu-kernels.md): the engine
#                               invariance test took ~2 h under TSan before, 525 s after
#   scripts/sanitize.sh all     asan then tsan
# Extra arguments go to ctest. Builds into ${TESSERA_BUILD_DIR:-build}-asan / -tsan.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
mode=${1:-quick}
shift || true
jobs=${TESSERA_JOBS:-$(nproc)}
base=${TESSERA_BUILD_DIR:-$root/build}

# Tests that need no real model weights and finish in seconds without a sanitizer.
quick_tests='^(unit_|conformance_|integration_cli_errors$)'
# Tests whose point is threads: the pool, the engine loop, the HTTP server.
# integration_replicas: the gateway's replica workers and health thread, drain, failover.
# conformance_test_kv_connector_conformance: cancels racing a call's end, from another thread.
# integration_test_kv_import_pipelined: a transfer thread writes KV layers while a forward
# reads the ones below.
# tsan_kernel_ranges_*: the uninstrumented matmul kernels' calls are still checked as ranges.
# Not integration_disaggregation: its prompts (4 concurrent ~900-token ones) take minutes per
# step through TSan's instrumented GEMM, past its transfer deadlines (docs/benchmarks.md,
# "Fourth round"); the threads it exercises are covered by the three tests above and ASan runs it.
tsan_tests='^(tsan_kernel_ranges_.*|unit_test_ggml_math|conformance_test_scheduler_conformance|conformance_test_kv_connector_conformance|integration_test_engine_invariance|integration_test_kv_import_pipelined|integration_server_robustness|integration_server_openai|integration_replicas)$'
# What those need (the app, every in-tree plugin, the four test executables): the TSan pass
# builds only these, not the whole tree.
tsan_targets=(tessera tessera_plugins tsan_kernel_ranges unit_test_ggml_math conformance_test_scheduler_conformance
              conformance_test_kv_connector_conformance integration_test_engine_invariance
              integration_test_kv_import_pipelined)

# -O1 with minimal debug info (-g1: line tables): what the sanitizers' docs recommend (fast
# enough to run the kernels, readable stacks) and much quicker to compile than -O2 -g.
build() {  # build DIR SANITIZERS [targets...]
  local dir=$1 sanitizers=$2
  shift 2
  cmake -S "$root" -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1" -DCMAKE_C_FLAGS_RELWITHDEBINFO="-O1" \
    -DTESSERA_SANITIZE="$sanitizers" -DTESSERA_ENABLE_CUDA=OFF >/dev/null
  if (($#)); then
    cmake --build "$dir" -j "$jobs" --target "$@"
  else
    cmake --build "$dir" -j "$jobs"
  fi
}

run() {  # run DIR REGEX [ctest args]
  local dir=$1 regex=$2
  shift 2
  # The plugins are loaded with dlopen, never unloaded while the process runs (by design):
  # their "leaks" at exit are the libraries' own static state, not ours, so LeakSanitizer
  # keeps reporting real leaks but ignores libraries it cannot symbolize at exit.
  export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=0:halt_on_error=1:detect_stack_use_after_return=0}
  export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
  # gRPC, abseil and glibc's dynamic TLS look racy to TSan without being so (not built with
  # it): scripts/tsan-suppressions.txt says which reports are theirs.
  export TSAN_OPTIONS=${TSAN_OPTIONS:-halt_on_error=1:second_deadlock_stack=1:suppressions=$root/scripts/tsan-suppressions.txt}
  # Tests that cannot run under a sanitizer (an impossible allocation, which ASan's operator
  # new reports instead of throwing) skip when this is set.
  export TESSERA_SANITIZER=${dir##*-}
  (cd "$dir" && ctest --output-on-failure --timeout 1800 -R "$regex" "$@")
}

case "$mode" in
  quick) build "$base-asan" address,undefined && run "$base-asan" "$quick_tests" "$@" ;;
  asan) build "$base-asan" address,undefined && run "$base-asan" '.' -E '^cuda' "$@" ;;
  tsan) build "$base-tsan" thread "${tsan_targets[@]}" && run "$base-tsan" "$tsan_tests" "$@" ;;
  all)
    build "$base-asan" address,undefined && run "$base-asan" '.' -E '^cuda' "$@"
    build "$base-tsan" thread "${tsan_targets[@]}" && run "$base-tsan" "$tsan_tests" "$@"
    ;;
  *) echo "usage: scripts/sanitize.sh [quick|asan|tsan|all] [ctest args]" >&2; exit 2 ;;
esac
