#!/usr/bin/env bash
# `tessera bench` latency / offline / ab / roofline / make-workload on the real model with
# tiny sizes, and serve against a mock server; python checks that each JSON report is
# complete and consistent. Exit 77 (skip) without the model unless TESSERA_REQUIRE_MODEL=1.
set -euo pipefail

bin="$TESSERA_BUILD_DIR/bin/tessera"
src="$TESSERA_SOURCE_DIR"
model_dir="${TESSERA_MODEL_DIR:-$HOME/.cache/tessera/models}"
if [[ ! -f "$model_dir/SmolLM2-135M-Instruct.Q4_1.gguf" ]]; then
  if [[ "${TESSERA_REQUIRE_MODEL:-}" == 1 ]]; then echo "FAIL: model missing in $model_dir"; exit 1; fi
  echo "skipped: model not found in $model_dir"; exit 77
fi
scratch="$TESSERA_BUILD_DIR/test-scratch/bench-cli"
rm -rf "$scratch" && mkdir -p "$scratch"
cd "$scratch"
check() { python3 - "$@"; }

echo "--- make-workload"
for kind in mixed shared-prefix uniform-output long-prompt-interference; do
  "$bin" bench make-workload -k "$kind" -n 10 -o "$kind.jsonl"
done
check <<'PY'
import json
def load(k): return [json.loads(l) for l in open(k + ".jsonl")]
mixed = load("mixed")
assert len(mixed) == 10
assert all(16 <= r["max_tokens"] <= 256 for r in mixed)
assert all(16 <= len(r["prompt_ids"]) <= 513 for r in mixed), [len(r["prompt_ids"]) for r in mixed]
shared = load("shared-prefix")
prefix = shared[0]["prompt_ids"][:500]
assert all(r["prompt_ids"][:500] == prefix for r in shared)
assert [r["arrival_s"] for r in shared] == sorted(r["arrival_s"] for r in shared)
assert shared[0]["tag"] == "first" and all(r["tag"] == "later" for r in shared[1:])
uni = load("uniform-output")
assert all(16 <= r["max_tokens"] <= 256 for r in uni)
lp = load("long-prompt-interference")
dec = [r for r in lp if r["tag"] == "decode"]
lng = [r for r in lp if r["tag"] == "long"]
assert len(dec) == 8 and len(lng) == 2
assert all(r["arrival_s"] == 0 for r in dec) and all(r["arrival_s"] > 0 for r in lng)
assert all(len(r["prompt_ids"]) >= 1000 for r in lng)
print("ok make-workload")
PY

# A tiny workload: 5 requests of 3-9 output tokens, one arriving later.
cat > tiny.jsonl <<'W'
{"id": "a", "prompt": "The capital of France is", "max_tokens": 5}
{"id": "b", "prompt": "Write a haiku about the sea.", "max_tokens": 9}
{"id": "c", "prompt": "1, 2, 3, 4,", "max_tokens": 3}
{"id": "d", "prompt": "Explain gravity to a child in one sentence.", "max_tokens": 7, "tag": "late", "arrival_s": 0.2}
{"id": "e", "prompt_ids": [1, 504, 3458, 282], "max_tokens": 4}
W

echo "--- latency"
"$bin" bench latency -p 16 -g 6 -r 2 --json latency.json --html latency.html
check <<'PY'
import json
j = json.load(open("latency.json"))
for k, n in (("pp", 16), ("tg", 6)):
    t = j[k]
    assert t["tokens"] == n and len(t["runs"]) == 2
    s = t["tokens_per_s"]
    assert 0 < s["min"] <= s["p50"] <= s["max"], s
    assert t["roofline_tokens_per_s"] > 0
    assert abs(t["fraction_of_roofline"] - s["p50"] / t["roofline_tokens_per_s"]) < 1e-9
assert j["machine"]["read_bandwidth_gb_s"] > 0 and j["machine"]["fma_peak_gflop_s"] > 0
assert 50e6 < j["model"]["weight_bytes_per_token"] < 200e6   # SmolLM2-135M Q4_1/Q8_0
assert 100e6 < j["model"]["matmul_params"] < 200e6
assert "<svg" in open("latency.html").read()
print("ok latency")
PY

echo "--- offline"
"$bin" bench offline -c "$src/configs/bench/batching-continuous.yaml" -w tiny.jsonl --json offline.json --html offline.html
check <<'PY'
import json
j = json.load(open("offline.json"))
m, reqs = j["metrics"], j["requests"]
want = {"a": 5, "b": 9, "c": 3, "d": 7, "e": 4}
assert {r["id"]: r["output_tokens"] for r in reqs} == want, reqs
assert all(r["requested_tokens"] == r["output_tokens"] and r["finish_reason"] == "length" for r in reqs)
assert m["completed"] == 5 and m["output_tokens"] == sum(want.values())
for p in ("ttft", "tpot", "itl", "late.ttft", "late.itl"):
    assert 0 <= m[p + "_p50_ms"] <= m[p + "_p90_ms"] <= m[p + "_p99_ms"], (p, m)
assert abs(m["output_tokens_per_s"] - m["output_tokens"] / m["makespan_s"]) < 1e-6
assert 1 <= m["peak_running"] <= 8 and 0 < m["mean_running"] <= m["peak_running"]
assert 0 <= m["mean_kv_waste"] < 1 and m["peak_kv_blocks_used"] <= m["kv_blocks_total"]
# batching-continuous.yaml: 256 MiB of 16-token f16 pages (22.5 KiB a slot for SmolLM2-135M).
assert abs(m["kv_pool_mib"] - m["kv_blocks_total"] * 16 * 23040 / 2**20) < 1e-6 and m["kv_pool_mib"] <= 256
assert abs(m["peak_kv_used_mib"] / m["kv_pool_mib"] - m["peak_kv_blocks_used"] / m["kv_blocks_total"]) < 1e-9
assert "<svg" in open("offline.html").read()
print("ok offline")
PY

echo "--- ab"
"$bin" bench ab "$src/configs/bench/batching-static.yaml" "$src/configs/bench/batching-continuous.yaml" \
  -w tiny.jsonl -r 2 --json ab.json --html ab.html
check <<'PY'
import json
j = json.load(open("ab.json"))
assert j["rounds"] == 2
m = j["metrics"]
ot = m["output_tokens"]
assert ot["a_rounds"] == [28, 28] and ot["b_rounds"] == [28, 28]
assert ot["verdict"] == "no significant difference" and ot["direction"] == 0
assert m["output_tokens_per_s"]["direction"] == 1 and m["itl_p99_ms"]["direction"] == -1
for name, x in m.items():
    a, b = x["a"], x["b"]
    assert len(x["a_rounds"]) == 2 and len(x["b_rounds"]) == 2
    assert a["min"] <= a["p50"] <= a["max"] and b["min"] <= b["p50"] <= b["max"]
    if b["p50"] != 0:
        assert abs(x["ratio_a_over_b"] - a["p50"] / b["p50"]) < 1e-9 * max(1, abs(x["ratio_a_over_b"])), name
    else:
        assert x["ratio_a_over_b"] is None, name
    assert x["direction"] in (-1, 0, 1)
    assert 0 <= x["mann_whitney_p"] <= 1
    separated = a["min"] > b["max"] or b["min"] > a["max"]
    assert (x["verdict"] != "no significant difference") == separated, (name, x)
assert "<svg" in open("ab.html").read()
print("ok ab")
PY

echo "--- roofline"
"$bin" bench roofline -c "$src/configs/bench/roofline.yaml" --max-batch 4 --steps 3 --json roofline.json --html roofline.html
check <<'PY'
import json
j = json.load(open("roofline.json"))
pts = j["points"]
assert [p["batch"] for p in pts] == [1, 2, 4]
for p in pts:
    s = p["step_ms"]
    assert s["n"] == 3 and 0 < s["min"] <= s["p50"] <= s["max"]
    assert abs(p["tokens_per_s"] - p["batch"] / (s["p50"] / 1e3)) < 1e-6 * p["tokens_per_s"]
assert j["memory_bound_step_floor_ms"] > 0 and j["ridge_batch"] > 0
assert j["knee_batch"] in (0, 2, 4)
assert "<svg" in open("roofline.html").read()
print("ok roofline")
PY

echo "--- serve (mock server: client parsing and counting only)"
python3 "$src/tests/bench/mock_openai_server.py" port.txt &
mock=$!
trap 'kill $mock 2>/dev/null || true' EXIT
for _ in $(seq 50); do [[ -s port.txt ]] && break; sleep 0.1; done
"$bin" bench serve --url "http://127.0.0.1:$(cat port.txt)" -w tiny.jsonl --concurrency 1,3 --rate 50 -n 6 \
  --slo-ttft 10s --slo-tpot 1s --json serve.json --html serve.html
check <<'PY'
import json
j = json.load(open("serve.json"))
lv = j["levels"]
assert [l["label"] for l in lv] == ["rate 50.00/s", "concurrency 1", "concurrency 3"]
for l in lv:
    m = l["metrics"]
    # 6 requests cycle through the 5 of tiny.jsonl: 5+9+3+7+4 + 5.
    assert m["completed"] == 6 and m["failed"] == 0 and m["output_tokens"] == 33, m
    for p in ("ttft", "tpot", "itl"):
        assert 0 <= m[p + "_p50_ms"] <= m[p + "_p90_ms"] <= m[p + "_p99_ms"]
    assert m["slo_attainment"] == 1.0 and m["goodput_requests_per_s"] == m["requests_per_s"]
assert "<svg" in open("serve.html").read()
print("ok serve")
PY
echo "all bench checks passed"
