#!/usr/bin/env python3
"""Prefix affinity against plain load balancing over replicas, side by side in one run.

Two engine processes (1 thread each, `replicas.listen`) behind a gateway (`local: false`). A
workload of G documents, each asked Q questions (the document is the shared prefix, ~500
tokens), sent by C concurrent clients in shuffled order. Arm "affinity" is router.prefix-affinity
as shipped (max_imbalance 4); arm "least-loaded" is the same router with max_imbalance 0, i.e.
always the replica with the fewest requests in flight (what a load balancer without prefix
knowledge does). Per arm: share of prompt tokens served from a prefix cache, TTFT p50/p99,
wall time. Both arms run on the same fresh processes' configuration; the engines are restarted
between arms so neither starts with a warm cache.

  python3 bench/replica_affinity.py [--groups 8] [--questions 6] [--clients 4] [--rounds 1]
"""
import argparse
import os
import random
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "integration"))
import server_harness as h  # noqa: E402

MODEL = "smollm2-135m-instruct-q4_1"
TOPICS = ["lighthouses", "glass", "bridges", "tea", "clocks", "maps", "salt", "paper", "ships", "wool", "iron", "bread"]


def document(g):
    t = TOPICS[g % len(TOPICS)]
    return " ".join(f"Record {i} of the {t} archive: entry {g * 100 + i} describes how {t} changed in year "
                    f"{1700 + 7 * i + g}." for i in range(24))


def replica_yaml(port):
    return (f"extends: {h.DEFAULT_STACK}\nmodel: {{path: {MODEL}, threads: 1}}\n"
            f"replicas:\n  connector: {{plugin: grpc}}\n  listen: 127.0.0.1:{port}\n")


def gateway_yaml(ports, imbalance):
    return (f"extends: {h.DEFAULT_STACK}\nmodel: {{path: {MODEL}, threads: 1}}\n"
            "engine:\n  kv_cache: {plugin: paged, block_size: 16, memory: 64MiB, dtype: f16, prefix_caching: true}\n"
            "replicas:\n  connector: {plugin: grpc}\n"
            f"  endpoints: [{', '.join(f'127.0.0.1:{p}' for p in ports)}]\n  local: false\n"
            f"  router: {{plugin: prefix-affinity, max_imbalance: {imbalance}}}\n")


def run_arm(name, imbalance, requests, clients):
    ports = [h.free_port(), h.free_port()]
    engines = [h.Gateway(replica_yaml(p), f"bench-replica-{i}").start() for i, p in enumerate(ports)]
    gw = h.Gateway(gateway_yaml(ports, imbalance), f"bench-gw-{name}").start()
    ttft, prompt_tokens, cached = [], 0, 0
    lock = threading.Lock()
    queue = list(requests)

    def client():
        nonlocal prompt_tokens, cached
        c = gw.openai_client(timeout=600)
        while True:
            with lock:
                if not queue:
                    return
                prompt = queue.pop()
            t0 = time.time()
            first = None
            usage = None
            for chunk in c.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stream=True,
                                              stream_options={"include_usage": True}):
                if first is None and chunk.choices and chunk.choices[0].text:
                    first = time.time() - t0
                if chunk.usage:
                    usage = chunk.usage
            with lock:
                ttft.append(first if first is not None else time.time() - t0)
                prompt_tokens += usage.prompt_tokens
                details = usage.prompt_tokens_details
                cached += (details.cached_tokens or 0) if details else 0

    start = time.time()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.time() - start
    routed = {}
    for line in gw.metrics().splitlines():
        if line.startswith("tessera_router_routed_total"):
            routed[line.split('replica="')[1].split('"')[0]] = float(line.split()[-1])
    for s in [gw] + engines:
        s.stop()
    ttft.sort()
    return {"arm": name, "cached_share": cached / prompt_tokens, "ttft_p50": statistics.median(ttft),
            "ttft_p99": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))], "wall": wall,
            "split": sorted(routed.values())}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--questions", type=int, default=6)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    h.require_environment()
    rng = random.Random(7)
    requests = [document(g) + f"\nQuestion {q}: which entry mentions year {1700 + 7 * q + g}?"
                for g in range(args.groups) for q in range(args.questions)]
    print(f"{len(requests)} requests: {args.groups} documents x {args.questions} questions, {args.clients} clients, "
          "2 engine processes (1 thread each) behind a gateway")
    print("| round | arm | prompt tokens from a prefix cache | TTFT p50 | TTFT p99 | wall | requests per replica |")
    print("|---|---|---|---|---|---|---|")
    for r in range(args.rounds):
        order = requests[:]
        rng.shuffle(order)
        for name, imbalance in (("affinity", 4), ("least-loaded", 0)):
            res = run_arm(name, imbalance, order, args.clients)
            print(f"| {r + 1} | {name} | {res['cached_share'] * 100:.1f} % | {res['ttft_p50'] * 1e3:.0f} ms | "
                  f"{res['ttft_p99'] * 1e3:.0f} ms | {res['wall']:.1f} s | {res['split']} |", flush=True)


if __name__ == "__main__":
    main()
