#!/usr/bin/env bash
# The out-of-tree plugin path, end to end: install the build's SDK into a scratch prefix,
# build examples/custom-sampler against it with find_package(tessera_sdk), then have the
# `tessera` app load the result by name from YAML (`config check`) and list it (`plugins`).
# Environment (set by ctest): TESSERA_SOURCE_DIR, TESSERA_BUILD_DIR, TESSERA_CXX_COMPILER,
# TESSERA_CMAKE_GENERATOR. Exits 77 (skipped) only when the app was not built.
set -euo pipefail

src=${TESSERA_SOURCE_DIR:?}
build=${TESSERA_BUILD_DIR:?}
tessera=$build/bin/tessera
scratch=$build/test-scratch/out-of-tree-plugin

fail() { echo "FAIL: $*" >&2; exit 1; }

if [[ ! -x $tessera ]]; then
  echo "SKIP: $tessera was not built" >&2
  exit 77
fi

rm -rf "$scratch"
mkdir -p "$scratch"

echo "== install the SDK into $scratch/prefix"
cmake --install "$build" --prefix "$scratch/prefix" > "$scratch/install.log" 2>&1 ||
  { cat "$scratch/install.log"; fail "cmake --install failed"; }
[[ -f $scratch/prefix/include/tessera/sdk.h ]] || fail "sdk.h was not installed"
config=$(find "$scratch/prefix" -name tessera_sdk-config.cmake | head -n1)
[[ -n $config ]] || fail "tessera_sdk-config.cmake was not installed"

echo "== build examples/custom-sampler against the installed SDK"
generator_args=()
if [[ -n ${TESSERA_CMAKE_GENERATOR:-} ]]; then generator_args=(-G "$TESSERA_CMAKE_GENERATOR"); fi
compiler_args=()
# The host refuses plugins built by another toolchain, so use the build's compiler.
if [[ -n ${TESSERA_CXX_COMPILER:-} ]]; then compiler_args=(-DCMAKE_CXX_COMPILER="$TESSERA_CXX_COMPILER"); fi
cmake -S "$src/examples/custom-sampler" -B "$scratch/plugin-build" "${generator_args[@]}" \
  "${compiler_args[@]}" -DCMAKE_PREFIX_PATH="$scratch/prefix" > "$scratch/configure.log" 2>&1 ||
  { cat "$scratch/configure.log"; fail "configuring the example failed"; }
cmake --build "$scratch/plugin-build" > "$scratch/build.log" 2>&1 ||
  { cat "$scratch/build.log"; fail "building the example failed"; }
plugin=$scratch/plugin-build/libtessera-sampler-typical.so
[[ -f $plugin ]] || fail "$plugin was not produced"

echo "== tessera plugins --kind sampler lists it"
TESSERA_PLUGIN_PATH=$scratch/plugin-build "$tessera" plugins --kind sampler > "$scratch/plugins.txt" ||
  { cat "$scratch/plugins.txt"; fail "tessera plugins failed"; }
cat "$scratch/plugins.txt"
grep -q "sampler.typical 0.1.0" "$scratch/plugins.txt" || fail "sampler.typical not listed"
grep -q "typical_p" "$scratch/plugins.txt" || fail "typical_p parameter not listed"
TESSERA_PLUGIN_PATH=$scratch/plugin-build "$tessera" plugins --kind sampler --json > "$scratch/plugins.json"
grep -q '"qualified_name": "sampler.typical"' "$scratch/plugins.json" || fail "JSON lacks sampler.typical"

echo "== the sampler conformance suite passes on it, found through TESSERA_PLUGIN_PATH"
suite=$build/tests/conformance_test_sampler_conformance
if [[ -x $suite ]]; then
  TESSERA_PLUGIN_PATH=$scratch/plugin-build "$suite" > "$scratch/conformance.txt" 2>&1 ||
    { tail -n 40 "$scratch/conformance.txt"; fail "sampler.typical failed the sampler conformance suite"; }
fi

echo "== tessera plugins lists declared capabilities (SDK 2.6)"
grep -q "capabilities: none" "$scratch/plugins.txt" || fail "the sampler's capabilities are not listed"
"$tessera" plugins --kind quantizer > "$scratch/quantizers.txt"
grep -q "capabilities: grouped_matmul" "$scratch/quantizers.txt" || fail "quantizer.gguf's grouped_matmul is not listed"
"$tessera" plugins --kind quantizer --json > "$scratch/quantizers.json"
grep -q '"capabilities": \[ *"grouped_matmul"' <(tr -d '\n' < "$scratch/quantizers.json") ||
  fail "the JSON lacks quantizer.gguf's capabilities"

echo "== tessera config check loads it by name through plugin_paths"
# The default engine slots need the in-tree plugins, as any real stack does.
cat > "$scratch/stack.yaml" <<YAML
plugin_paths: [plugin-build]
model: {path: smollm2-135m-instruct-q4_1}
engine:
  sampler: {plugin: typical, typical_p: 0.8, min_keep: 3}
YAML
if ! "$tessera" config check "$scratch/stack.yaml" > "$scratch/check.txt" 2>&1; then
  cat "$scratch/check.txt"
  fail "config check of a stack using the out-of-tree plugin failed"
fi
cat "$scratch/check.txt"
grep -q "stack.yaml: ok" "$scratch/check.txt" || fail "config check did not say ok"
grep -q "engine.sampler: *typical  typical_p=0.8 min_keep=3" "$scratch/check.txt" ||
  fail "the resolved sampler slot is not the plugin with its params"
grep -q "from $plugin" "$scratch/check.txt" || fail "the sampler does not come from $plugin"

echo "== a bad parameter of the out-of-tree plugin is reported with its line"
cat > "$scratch/bad.yaml" <<YAML
plugin_paths: [plugin-build]
model: {path: smollm2-135m-instruct-q4_1}
engine:
  sampler: {plugin: typical, typical_p: 1.5}
YAML
if "$tessera" config check "$scratch/bad.yaml" > "$scratch/bad.txt" 2>&1; then
  cat "$scratch/bad.txt"
  fail "config check accepted typical_p: 1.5"
fi
cat "$scratch/bad.txt"
grep -q "bad.yaml:4:41: engine.sampler.typical_p: expected a number in \[0, 1\], got 1.5" \
  "$scratch/bad.txt" || fail "unexpected message for typical_p: 1.5"

echo "PASS"
