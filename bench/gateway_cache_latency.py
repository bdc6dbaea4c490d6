#!/usr/bin/env python3
"""Latency of an exact-cache hit (in-process and Redis tiers), or of a semantic-cache hit,
against a model call.

Starts a redis-server on a free loopback port and two `tessera serve` gateways (the default
stack behind `cache_layer.exact` with that Redis), then for N distinct chat prompts
(temperature 0, max_tokens M, non-streamed, one at a time):

  model   gateway A, first time: a miss, the model answers (and A stores it);
  memory  gateway A again: a hit in A's in-process tier;
  redis   gateway B, first time: a hit in the shared Redis tier.

Each sample is the client's wall time for the whole HTTP request (httpx, keep-alive). Every
hit is checked to carry the original text and the expected x-tessera-cache header.

  python3 bench/gateway_cache_latency.py -n 100 --max-tokens 32 [--json out.json]

With --layer semantic: one gateway with the embedding model and `cache_layer.semantic`
(threshold 0.8); `model` is the first, distinct prompt of each pair (a miss: embedding + the
model), `semantic` a reworded one ("Please tell me about X." after "What can you tell me about X?", X a WordNet noun), a hit whose text is checked against
the original. The hit's time includes embedding the prompt.

  python3 bench/gateway_cache_latency.py --layer semantic -n 100 --max-tokens 32
"""
import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "integration"))
import server_harness as h  # noqa: E402
from server_harness import Gateway, Redis  # noqa: E402  (the tests' redis-server and config helpers)

import httpx  # noqa: E402


def percentile(values, p):
    v = sorted(values)
    k = (len(v) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=100, help="distinct prompts")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--json")
    ap.add_argument("--layer", choices=("exact", "semantic"), default="exact")
    args = ap.parse_args()
    if args.layer == "semantic":
        return semantic(args)

    redis = Redis().start()
    yaml = f"""extends: {h.DEFAULT_STACK}
gateway:
  cache: [{{plugin: exact, ttl: 10m, max_bytes: 64MiB, redis_url: "redis://127.0.0.1:{redis.port}"}}]
"""
    a = Gateway(yaml, "latency-a").start(timeout=240)
    b = Gateway(yaml, "latency-b").start(timeout=240)
    try:
        model = httpx.get(a.url + "/v1/models").json()["data"][0]["id"]
        ca, cb = httpx.Client(base_url=a.url, timeout=120), httpx.Client(base_url=b.url, timeout=120)
        samples = {"model": [], "memory": [], "redis": []}
        stamp = time.time_ns()

        def call(client, i, expect):
            body = {"model": model, "temperature": 0, "max_tokens": args.max_tokens,
                    "messages": [{"role": "user", "content": f"Question {i} ({stamp}): tell me about topic {i}."}]}
            t0 = time.perf_counter()
            r = client.post("/v1/chat/completions", json=body)
            dt = time.perf_counter() - t0
            assert r.status_code == 200, r.text
            assert r.headers["x-tessera-cache"] == expect, (r.headers["x-tessera-cache"], expect)
            return dt, r.json()["choices"][0]["message"]["content"]

        originals = []
        for i in range(args.n):
            dt, text = call(ca, i, "miss")
            samples["model"].append(dt)
            originals.append(text)
        deadline = time.time() + 30
        while len(redis.keys()) < args.n and time.time() < deadline:
            time.sleep(0.05)
        for i in range(args.n):
            dt, text = call(ca, i, "hit; layer=exact; tier=memory; similarity=1.0000")
            assert text == originals[i]
            samples["memory"].append(dt)
        for i in range(args.n):
            dt, text = call(cb, i, "hit; layer=exact; tier=redis; similarity=1.0000")
            assert text == originals[i]
            samples["redis"].append(dt)
        report_latency(samples, args)
    finally:
        for g in (a, b):
            g.stop()
        redis.kill()


def report_latency(samples, args, extra=None):
    report = {}
    for name, v in samples.items():
        report[name] = {"n": len(v), "p50_ms": percentile(v, 50) * 1e3, "p99_ms": percentile(v, 99) * 1e3,
                        "mean_ms": statistics.mean(v) * 1e3}
        print(f"{name:8s} n={len(v)}  p50 {report[name]['p50_ms']:8.2f} ms  p99 {report[name]['p99_ms']:8.2f} ms"
              f"  mean {report[name]['mean_ms']:8.2f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"max_tokens": args.max_tokens, "prompts": args.n, "layer": args.layer, "latency": report,
                       **(extra or {})}, f, indent=2)


def semantic(args):
    yaml = f"""extends: {h.DEFAULT_STACK}
embedding: {{model: {{path: all-MiniLM-L6-v2, threads: 2}}}}
gateway:
  cache: [{{plugin: semantic, threshold: 0.8, ttl: 10m}}]
"""
    g = Gateway(yaml, "latency-semantic").start(timeout=240)
    try:
        model = httpx.get(g.url + "/v1/models").json()["data"][0]["id"]
        client = httpx.Client(base_url=g.url, timeout=120)
        samples = {"model": [], "semantic": []}
        similarities = []
        # Distinct topics, so that no two first prompts are near each other: nouns from WordNet
        # (Debian wordnet-base), every k-th single word of index.noun.
        with open("/usr/share/wordnet/index.noun", encoding="latin-1") as f:
            nouns = [line.split()[0] for line in f if not line.startswith(" ") and line[0].isalpha()
                     and "_" not in line.split()[0] and len(line.split()[0]) >= 6]
        topics = nouns[:: max(1, len(nouns) // args.n)][: args.n]

        def call(content, expect_hit):
            body = {"model": model, "temperature": 0, "max_tokens": args.max_tokens,
                    "messages": [{"role": "user", "content": content}]}
            t0 = time.perf_counter()
            r = client.post("/v1/chat/completions", json=body)
            dt = time.perf_counter() - t0
            assert r.status_code == 200, r.text
            header = r.headers["x-tessera-cache"]
            assert header.startswith("hit; layer=semantic") == expect_hit, header
            if expect_hit:
                similarities.append(float(header.rsplit("=", 1)[1]))
            return dt, r.json()["choices"][0]["message"]["content"]

        for i in range(args.n):
            dt, text = call(f"What can you tell me about {topics[i]}?", False)
            samples["model"].append(dt)
            dt, hit = call(f"Please tell me about {topics[i]}.", True)
            assert hit == text
            samples["semantic"].append(dt)
        report_latency(samples, args, {"similarity_min": min(similarities), "similarity_max": max(similarities)})
        print(f"hit similarities {min(similarities):.4f} .. {max(similarities):.4f}")
    finally:
        g.stop()


if __name__ == "__main__":
    main()
