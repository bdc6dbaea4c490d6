#!/usr/bin/env bash
# Installs what building and testing Tessera needs on Debian bookworm (run as root, or with
# sudo available). Packages already present are left alone, so a second run is quick.
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config git
  libboost-dev libboost-filesystem-dev libboost-system-dev
  libyaml-cpp-dev libspdlog-dev libfmt-dev nlohmann-json3-dev libcli11-dev doctest-dev libssl-dev
  protobuf-compiler libprotobuf-dev
  libgrpc++-dev protobuf-compiler-grpc  # kv_connector.grpc: KV transfer between prefill and decode engines
  libhiredis-dev redis-server  # the exact cache's Redis tier; the gateway and dashboard tests start one
  libhnswlib-dev  # cache_layer.semantic's HNSW index
  wordnet-base  # the semantic-cache bench's paraphrase pairs (bench/make_paraphrase_pairs.py)
  python3 python3-pip
  chromium                     # headless, for the /dashboard test (tests/integration/test_server_dashboard.py)
  iproute2                     # `ip netns`: the second "host" of tests/integration/test_second_host.py
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  sudo=""
  [[ $(id -u) -eq 0 ]] || sudo="sudo"
  echo "install-deps: installing ${missing[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# Python packages the server tests and bench/load_test.py use (pinned): the official OpenAI
# client, httpx, and prometheus_client (its text parser checks /metrics); the clients of
# issue 16: lm-eval (with its API extra; transformers loads the exported tokenizer for it),
# tokenizers (reads `tessera tokenizer export`'s tokenizer.json), jsonschema (validates
# structured answers) and LangChain's OpenAI client with the langchain-core and pydantic it
# runs on (langchain-openai 1.1.0: the newest that accepts openai 2.8.1). Installed only when
# missing or at another version (lm-eval and its dependencies: about 5 minutes on a fresh
# machine).
python_packages=(openai==2.8.1 httpx==0.28.1 prometheus-client==0.21.1
                 lm-eval==0.4.13 tokenizers==0.23.3 transformers==5.24.0 jsonschema==4.26.0
                 langchain-openai==1.1.0 langchain-core==1.8.3 pydantic==2.13.4)
if ! python3 - "${python_packages[@]}" <<'PY' 2>/dev/null
import sys
from importlib.metadata import version
for spec in sys.argv[1:]:
    name, want = spec.split("==")
    if version(name) != want:
        sys.exit(1)
PY
then
  echo "install-deps: installing ${python_packages[*]} with pip"
  # Debian's own python3 is "externally managed" (PEP 668): pip needs to be told explicitly.
  python3 -m pip install --quiet "${python_packages[@]}" "lm-eval[api]==0.4.13" 2>/dev/null ||
    python3 -m pip install --quiet --break-system-packages "${python_packages[@]}" "lm-eval[api]==0.4.13"
fi
