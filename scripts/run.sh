#!/usr/bin/env bash
# The main job, from a fresh Debian machine: installs dependencies, builds, fetches the default
# model, then runs `tessera` on the default stack (configs/smollm2-cpu.yaml). With no
# arguments it starts the OpenAI-compatible server (`tessera serve`, on the config's
# server.host:port, 127.0.0.1:8080, unless TESSERA_HOST / TESSERA_PORT say otherwise) and prints a curl line to call it; Ctrl-C stops
# it. Otherwise the arguments are a tessera command line, e.g.
#   scripts/run.sh generate --prompt "The capital of France is" --temperature 0
#   scripts/run.sh chat
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/install-deps.sh"
"$root/scripts/build.sh" >/dev/null
"$root/scripts/fetch-models.sh"
bin="${TESSERA_BUILD_DIR:-$root/build}/bin/tessera"
if (($# == 0)); then
  # `tessera serve` prints the address and a ready-to-paste curl command once it listens.
  serve_args=()
  [[ -n "${TESSERA_HOST:-}" ]] && serve_args+=(--host "$TESSERA_HOST")
  [[ -n "${TESSERA_PORT:-}" ]] && serve_args+=(--port "$TESSERA_PORT")
  exec "$bin" serve "${serve_args[@]}"
fi
exec "$bin" "$@"
