#!/usr/bin/env python3
"""The classifier router scored on live traffic: the held-out labelled prompts through a real
`tessera serve` with `model: auto`.

Starts one gateway with the two deployments of configs/gateway-router.yaml (SmolLM2-135M
`small`, Gemma 3 270M `large`), the embedding model and `router.classifier` with the given
router file, and no response cache (so every answer comes from a model). Each held-out row
(`tessera router train --heldout-out`) is asked the way it was labelled (a few-shot completion
prompt to /v1/completions, or a chat turn), greedy, max_tokens 12, a few at a time. Reports:

- the share routed to `small`, and the cost against always-large (a small call costs
  --small-cost of a large one, as in training);
- answer quality: the served answers checked like the labels (scripts/make-router-labels.py's
  `correct`), beside always-small, always-large and the oracle (from the rows' labels);
- misroutes: prompts only the large model answers sent to `small`, and the others sent to
  `large`;
- whether each served answer equals the labelled output of the deployment that answered
  (greedy on the same stack: it should);
- client latency per arm, and the router's decision time from /metrics.

  python3 bench/router_eval.py [--router data/router/router.json] [--data data/router/heldout.jsonl] [--json out.json]
"""
import argparse
import concurrent.futures
import importlib.util
import json
import os
import sys
import time
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "integration"))
import server_harness as h  # noqa: E402
from load_test import percentile  # noqa: E402

SOURCE = os.path.abspath(h.SOURCE_DIR)
_spec = importlib.util.spec_from_file_location("labels", os.path.join(SOURCE, "scripts", "make-router-labels.py"))
labels = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(labels)


def ask(url, row):
    path, body = labels.labelling_request(row["prompt"], row.get("format", "chat"), "auto")
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        out = json.load(r)
        route = r.headers.get("x-tessera-route", "")
    return out["model"], route, labels.answer_text(out["choices"][0]), time.perf_counter() - t0


def metric_sum(metrics_text, name):
    total = 0.0
    for line in metrics_text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--router", default=os.path.join(SOURCE, "data", "router", "router.json"))
    ap.add_argument("--data", default=os.path.join(SOURCE, "data", "router", "heldout.jsonl"))
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--small-cost", type=float, default=0.5)
    ap.add_argument("--json")
    args = ap.parse_args()
    with open(args.data) as f:
        rows = [json.loads(line) for line in f if line.strip()]

    yaml = f"""deployments:
  small: {{extends: {SOURCE}/configs/smollm2-cpu.yaml}}
  large: {{extends: {SOURCE}/configs/gemma3-270m.yaml}}
embedding: {{model: {{path: all-MiniLM-L6-v2, threads: 2}}}}
gateway:
  router: {{plugin: classifier, name: auto, model: {os.path.abspath(args.router)}, small: small, large: large}}
server: {{max_queued_requests: 1024}}
"""
    server = h.Gateway(yaml, "router-eval").start(timeout=600)
    try:
        with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
            served = list(pool.map(lambda r: ask(server.url, r), rows))
        metrics = server.metrics()
    finally:
        server.stop()

    n = len(rows)
    per_arm = {"small": [], "large": []}
    right = same_as_label = hard_small = easy_large = 0
    for row, (arm, route, text, seconds) in zip(rows, served):
        assert route == "auto=" + arm, (route, arm)
        per_arm[arm].append(seconds)
        kind = "int" if row["answer"].isdigit() else "text"
        right += labels.correct(text, row["answer"], kind)
        same_as_label += text == row[f"{arm}_output"]
        hard_small += row["label"] == "large" and arm == "small"
        easy_large += row["label"] == "small" and arm == "large"
    small_share = len(per_arm["small"]) / n
    result = {
        "router": os.path.relpath(args.router, SOURCE), "data": os.path.relpath(args.data, SOURCE), "prompts": n,
        "labelled_large": sum(r["label"] == "large" for r in rows),
        "small_share": small_share,
        "cost_vs_always_large": small_share * args.small_cost + (1 - small_share),
        "quality_routed": right / n,
        "quality_always_small": sum(r["small_correct"] for r in rows) / n,
        "quality_always_large": sum(r["large_correct"] for r in rows) / n,
        "quality_oracle": sum(r["small_correct"] or r["large_correct"] for r in rows) / n,
        "label_accuracy": 1 - (hard_small + easy_large) / n,
        "misroute_hard_to_small": hard_small / n, "misroute_easy_to_large": easy_large / n,
        "answers_equal_to_labelled_output": same_as_label,
        "latency_s": {arm: {"n": len(v), "p50": percentile(v, 50), "p99": percentile(v, 99)} for arm, v in per_arm.items()},
        "decision_ms_mean": 1000 * metric_sum(metrics, "tessera_router_decision_seconds_sum") /
                            max(1.0, metric_sum(metrics, "tessera_router_decision_seconds_count")),
    }
    print(f"{n} held-out prompts ({result['labelled_large']} labelled large) through `model: auto`, "
          f"{args.concurrency} at a time")
    print(f"  routed to small        {small_share:.3f}   cost vs always-large {result['cost_vs_always_large']:.3f}")
    print(f"  answered correctly     routed {result['quality_routed']:.3f}   always-small "
          f"{result['quality_always_small']:.3f}   always-large {result['quality_always_large']:.3f}   "
          f"oracle {result['quality_oracle']:.3f}")
    print(f"  route = label          {result['label_accuracy']:.3f}   hard->small {result['misroute_hard_to_small']:.3f}"
          f"   easy->large {result['misroute_easy_to_large']:.3f}")
    print(f"  answers equal to the labelled output of the arm that answered: {same_as_label}/{n}")
    for arm, lat in result["latency_s"].items():
        print(f"  {arm:5} {lat['n']:4} requests   latency p50 {lat['p50'] * 1000:.0f} ms   p99 {lat['p99'] * 1000:.0f} ms")
    print(f"  router decision (embedding + score) mean {result['decision_ms_mean']:.2f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
