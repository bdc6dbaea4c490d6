#!/usr/bin/env bash
# The whole test suite, from a fresh Debian machine: installs dependencies, fetches the
# default model (tests compare it with llama.cpp fixtures), runs the quick ASan+UBSan pass
# (scripts/sanitize.sh quick: unit, conformance and CLI error tests in a sanitizer build),
# builds, runs ctest. The full sanitizer matrix is `scripts/sanitize.sh all`.
#
# TESSERA_SKIP_SANITIZERS=1 skips the sanitizer pass (a quicker local loop; CI never sets it).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/install-deps.sh"
"$root/scripts/fetch-models.sh"

# The sanitizer pass runs first so that the run still ends in the main suite's ctest summary;
# its failure is remembered, reported and turned into the exit status after the main suite.
sanitizer_status=0
if [[ "${TESSERA_SKIP_SANITIZERS:-0}" != 1 ]]; then
  "$root/scripts/sanitize.sh" quick || sanitizer_status=$?
fi

"$root/scripts/build.sh"
# The real-model tests must not silently skip here.
export TESSERA_REQUIRE_MODEL=1
cd "${TESSERA_BUILD_DIR:-$root/build}"
suite_status=0
if ((sanitizer_status != 0)); then
  echo "scripts/test.sh: the ASan+UBSan pass (scripts/sanitize.sh quick) FAILED (exit $sanitizer_status); see above" >&2
fi
ctest --output-on-failure --timeout 1500 "$@" || suite_status=$?
if ((suite_status != 0)); then exit "$suite_status"; fi
exit "$sanitizer_status"
