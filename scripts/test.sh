#!/usr/bin/env bash
# The whole test suite, from a fresh Debian machine: installs dependencies, fetches the
# default model (tests compare it with llama.cpp fixtures), builds, runs ctest.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/install-deps.sh"
"$root/scripts/fetch-models.sh"
"$root/scripts/build.sh"
# The real-model tests must not silently skip here.
export TESSERA_REQUIRE_MODEL=1
cd "${TESSERA_BUILD_DIR:-$root/build}"
ctest --output-on-failure --timeout 1500 "$@"
