#!/usr/bin/env bash
# Every in-tree plugin builds from the installed SDK alone, and what it builds passes the
# conformance suites: install the build's SDK into a scratch prefix, configure
# tests/sdk/plugins-against-sdk (all plugins/<kind>/<name> in one project) against it, build
# with -j2, then run the conformance suites with TESSERA_PLUGIN_DIR pointing at those
# libraries instead of the build's; build examples/custom-attention the same way and run the
# attention suite on it from TESSERA_PLUGIN_PATH. Also: no plugin includes a path outside the SDK.
# The CUDA plugins are part of it where the build has CUDA (nvcc found): their kernels are the
# SDK's (tessera::cuda_kernels), so they build from the installed SDK like the CPU ones.
# Environment (set by ctest): TESSERA_SOURCE_DIR, TESSERA_BUILD_DIR, TESSERA_CXX_COMPILER,
# TESSERA_CMAKE_GENERATOR, TESSERA_CXX_LAUNCHER (ccache, when the build uses it).
set -euo pipefail

src=${TESSERA_SOURCE_DIR:?}
build=${TESSERA_BUILD_DIR:?}
scratch=$build/test-scratch/plugins-against-sdk

fail() { echo "FAIL: $*" >&2; exit 1; }

echo "== no plugin includes a path outside the SDK"
# Quoted includes must be the plugin's own files or tessera/sdk*; ../ reaches out of the folder.
offenders=$(grep -rnE '#include "(\.\./|tessera/)' "$src/plugins" --include='*.cpp' --include='*.h' \
  --include='*.cu' --include='*.cuh' | grep -vE '#include "tessera/sdk(\.h|/)' || true)
[[ -z $offenders ]] || fail "plugins include non-SDK headers:"$'\n'"$offenders"

rm -rf "$scratch"
mkdir -p "$scratch"
echo "== install the SDK into $scratch/prefix"
# The SDK component alone (headers, package config, libtessera_kernels.a): what a third party
# gets, and all the plugins may use.
cmake --install "$build" --prefix "$scratch/prefix" --component sdk > "$scratch/install.log" 2>&1 ||
  { cat "$scratch/install.log"; fail "cmake --install failed"; }
[[ -f $scratch/prefix/include/tessera/sdk/kernels/ggml_types.h ]] || fail "the kernel helpers were not installed"
find "$scratch/prefix" -name 'libtessera_kernels.a' | grep -q . || fail "libtessera_kernels.a was not installed"
# With CUDA, the CUDA kernel helpers are part of the SDK as well.
has_cuda=0
if [[ -f $build/plugins/libtessera-backend-cuda.so ]]; then
  has_cuda=1
  find "$scratch/prefix" -name 'libtessera_cuda_kernels.a' | grep -q . ||
    fail "libtessera_cuda_kernels.a was not installed (the build has CUDA)"
fi
# The core's private headers are not part of the SDK.
[[ ! -e $scratch/prefix/include/tessera/engine.h ]] || fail "core headers were installed with the SDK"

echo "== configure every plugins/<kind>/<name> against it"
args=(-DCMAKE_PREFIX_PATH="$scratch/prefix" -DTESSERA_PLUGINS_SOURCE="$src/plugins")
if [[ -n ${TESSERA_CMAKE_GENERATOR:-} ]]; then args+=(-G "$TESSERA_CMAKE_GENERATOR"); fi
# The host refuses plugins built by another toolchain, so use the build's compiler.
if [[ -n ${TESSERA_CXX_COMPILER:-} ]]; then args+=(-DCMAKE_CXX_COMPILER="$TESSERA_CXX_COMPILER"); fi
if [[ -n ${TESSERA_CXX_LAUNCHER:-} ]]; then args+=(-DCMAKE_CXX_COMPILER_LAUNCHER="$TESSERA_CXX_LAUNCHER"); fi
cmake -S "$src/tests/sdk/plugins-against-sdk" -B "$scratch/build" "${args[@]}" > "$scratch/configure.log" 2>&1 ||
  { cat "$scratch/configure.log"; fail "configuring the plugins against the installed SDK failed"; }
echo "== build them (-j2)"
cmake --build "$scratch/build" -j2 > "$scratch/build.log" 2>&1 ||
  { tail -n 60 "$scratch/build.log"; fail "building the plugins against the installed SDK failed"; }

echo "== every plugin of the build was produced"
expected=0
for lib in "$build"/plugins/libtessera-*.so; do
  name=$(basename "$lib")
  expected=$((expected + 1))
  [[ -f $scratch/build/plugins/$name ]] || fail "$name was not built against the installed SDK"
done
(( expected >= 15 )) || fail "only $expected plugins in $build/plugins"
echo "$expected plugins built against the installed SDK (CUDA plugins included: $has_cuda)"

echo "== the conformance suites pass on the libraries built against the installed SDK"
for suite in "$build"/tests/conformance_test_*_conformance "$build"/bin/conformance_test_*_conformance; do
  [[ -x $suite ]] || continue
  echo "-- $(basename "$suite")"
  TESSERA_PLUGIN_DIR=$scratch/build/plugins "$suite" > "$scratch/$(basename "$suite").log" 2>&1 ||
    { tail -n 40 "$scratch/$(basename "$suite").log"; fail "$(basename "$suite") failed on the SDK-built plugins"; }
done
echo "== examples/custom-attention, built against the installed SDK, passes the attention suite"
cmake -S "$src/examples/custom-attention" -B "$scratch/custom-attention" "${args[@]}" \
  > "$scratch/custom-attention-configure.log" 2>&1 ||
  { cat "$scratch/custom-attention-configure.log"; fail "configuring examples/custom-attention failed"; }
cmake --build "$scratch/custom-attention" -j2 > "$scratch/custom-attention-build.log" 2>&1 ||
  { cat "$scratch/custom-attention-build.log"; fail "building examples/custom-attention failed"; }
[[ -f $scratch/custom-attention/libtessera-attention-online.so ]] || fail "libtessera-attention-online.so was not produced"
attention_suite=$build/tests/conformance_test_attention_conformance
[[ -x $attention_suite ]] || fail "$attention_suite was not built"
# Out of tree, as a third party runs it: the build's plugins plus TESSERA_PLUGIN_PATH.
TESSERA_PLUGIN_PATH=$scratch/custom-attention "$attention_suite" > "$scratch/online-attention.log" 2>&1 ||
  { tail -n 60 "$scratch/online-attention.log"; fail "attention.online failed the attention conformance suite"; }
grep -q "host attention plugins under test: .*online" "$scratch/online-attention.log" ||
  { cat "$scratch/online-attention.log"; fail "the attention suite did not run attention.online"; }
echo "PASS"
