#!/usr/bin/env bash
# The main job, from a fresh Debian machine: installs dependencies, builds, fetches the default
# model, then runs `tessera` on the default stack (configs/smollm2-cpu.yaml). With no
# arguments it opens a chat; otherwise the arguments are a tessera command line, e.g.
#   scripts/run.sh generate --prompt "The capital of France is" --temperature 0
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/install-deps.sh"
"$root/scripts/build.sh" >/dev/null
"$root/scripts/fetch-models.sh"
bin="${TESSERA_BUILD_DIR:-$root/build}/bin/tessera"
if (($# == 0)); then
  if [[ -t 0 ]]; then
    exec "$bin" chat
  fi
  # Not a terminal (CI, a pipe): one demonstration answer instead of an interactive chat.
  exec "$bin" generate --chat --temperature 0 --max-tokens 96 \
    --prompt "In two sentences, what is a large language model?"
fi
exec "$bin" "$@"
