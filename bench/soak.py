#!/usr/bin/env python3
"""Soak test of `tessera serve`: many streaming clients for a long time, with faults mixed in.

    python3 bench/soak.py --clients 64 --minutes 30 [--config configs/smollm2-cpu.yaml]
                          [--json soak.json]

Starts a real server on loopback (tests/integration/server_harness.py), then runs --clients
threads until --minutes have passed. Each request is drawn at random:
  - a streaming chat or completion, max_tokens from 1 up to what the context leaves;
  - n > 1 (non-streaming), stop strings, seeds;
  - cancelled: the client closes the stream after a random number of events;
  - deliberately bad (wrong types, out-of-range numbers, unknown model, broken JSON): must
    get a 4xx and nothing else.
At the end it waits for the engine to drain and reports: requests completed, failed (only the
deliberately bad ones may fail: anything else is a defect), cancelled, truncated (a stream
that ended without its final [DONE] or finish_reason while the client was still reading: must
be 0), KV blocks still used (must be 0), the server's RSS each minute after warm-up (flat:
the spread is printed) and p50/p99 end-to-end latency per minute. Exit status 1 when any check
fails. Bounded: every loop stops at the deadline; every request has a timeout.
"""
import argparse
import json
import os
import random
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "integration"))
import server_harness  # noqa: E402

import httpx  # noqa: E402

CONTEXT = 2048

PROMPTS = [
    "Write a short poem about the sea.",
    "Explain what a hash table is in two sentences.",
    "List five fruits.",
    "Summarize: The quick brown fox jumps over the lazy dog. " * 8,
    "Translate to French: Good morning, how are you?",
    "def fibonacci(n):",
    "Once upon a time",
]

BAD_BODIES = [
    (b'{"model": "m", "prompt": "x", "max_tokens": 1e400}', "overflowing number"),
    (b'{"model": "m", "prompt": "x", "temperature": "hot"}', "wrong type"),
    (b'{"model": "m", "prompt": "x", "max_tokens": -5}', "negative max_tokens"),
    (b'{"model": "m", "prompt": "x", "max_tokens": 100000}', "past the context"),
    (b'{"model": "m", "prompt": [[[[[[[[[[1]]]]]]]]]]}', "nested prompt"),
    (b'{"model": "m", "prompt": ' + b"[" * 100000 + b"]" * 100000 + b"}", "deep nesting"),
    (b'{"model": "m", "prompt": "x"', "broken JSON"),
    (b'{"model": "m", "messages": [{"role": "robot", "content": "x"}]}', "bad role"),
]


class Stats:
    def __init__(self):
        self.lock = threading.Lock()
        self.counts = {"completed": 0, "cancelled": 0, "bad_rejected": 0, "failed": 0,
                       "truncated": 0}
        self.failures = []
        self.latencies = []  # (minute, seconds)

    def add(self, what, minute=None, latency=None, detail=None):
        with self.lock:
            self.counts[what] += 1
            if latency is not None:
                self.latencies.append((minute, latency))
            if detail and len(self.failures) < 50:
                self.failures.append(detail)


def stream_request(client, url, rng, stats, minute):
    chat = rng.random() < 0.5
    prompt = rng.choice(PROMPTS)
    max_tokens = rng.choice([1, 8, 32, 64, 128, rng.randint(1, CONTEXT - 600)])
    body = {"model": "smollm2-135m-instruct-q4_1", "max_tokens": max_tokens, "stream": True,
            "temperature": rng.choice([0, 0.7, 1.0])}
    if rng.random() < 0.3:
        body["stop"] = [rng.choice([".", "\n", " the", "!"])]
    if rng.random() < 0.3:
        body["seed"] = rng.randint(0, 1 << 30)
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = prompt
        path = "/v1/completions"
    cancel_after = rng.randint(1, 20) if rng.random() < 0.2 else None
    start = time.time()
    events = 0
    finished = False
    with client.stream("POST", url + path, json=body, timeout=600) as r:
        if r.status_code != 200:
            stats.add("failed", detail=f"{path} {r.status_code}: {r.read()[:200]!r}")
            return
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                finished = True
                break
            events += 1
            chunk = json.loads(data)
            if "error" in chunk:
                stats.add("failed", detail=f"stream error: {chunk['error']}")
                return
            if cancel_after is not None and events >= cancel_after:
                stats.add("cancelled")
                return  # leaving the with-block closes the connection mid-stream
    if finished:
        stats.add("completed", minute, time.time() - start)
    else:
        stats.add("truncated", detail=f"{path}: stream ended after {events} events without [DONE]")


def n_request(client, url, rng, stats, minute):
    body = {"model": "smollm2-135m-instruct-q4_1", "prompt": rng.choice(PROMPTS),
            "max_tokens": rng.randint(1, 48), "n": rng.randint(2, 4), "temperature": 0.8}
    start = time.time()
    r = client.post(url + "/v1/completions", json=body, timeout=600)
    if r.status_code == 200 and len(r.json()["choices"]) == body["n"]:
        stats.add("completed", minute, time.time() - start)
    else:
        stats.add("failed", detail=f"n={body['n']}: {r.status_code} {r.text[:200]}")


def bad_request(client, url, rng, stats):
    raw, what = rng.choice(BAD_BODIES)
    r = client.post(url + "/v1/completions", content=raw,
                    headers={"Content-Type": "application/json"}, timeout=60)
    if 400 <= r.status_code < 500:
        stats.add("bad_rejected")
    else:
        stats.add("failed", detail=f"bad request ({what}) got {r.status_code}")


def client_loop(url, seed, deadline, start, stats):
    rng = random.Random(seed)
    with httpx.Client() as client:
        while time.time() < deadline:
            minute = int((time.time() - start) // 60)
            kind = rng.random()
            try:
                if kind < 0.1:
                    bad_request(client, url, rng, stats)
                elif kind < 0.2:
                    n_request(client, url, rng, stats, minute)
                else:
                    stream_request(client, url, rng, stats, minute)
            except httpx.HTTPError as e:
                stats.add("failed", detail=f"transport: {type(e).__name__}: {e}")


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--minutes", type=float, default=30)
    ap.add_argument("--warmup-minutes", type=float, default=2, help="RSS before this is not judged")
    ap.add_argument("--json", help="write the report here")
    args = ap.parse_args()
    server_harness.require_environment(("httpx",))
    server = server_harness.Server("max_queued_requests: 1024", name="soak").start()
    stats = Stats()
    start = time.time()
    deadline = start + args.minutes * 60
    threads = [threading.Thread(target=client_loop, args=(server.url, i, deadline, start, stats))
               for i in range(args.clients)]
    for t in threads:
        t.start()
    rss = []  # (minute, KiB)
    while any(t.is_alive() for t in threads):
        rss.append((round((time.time() - start) / 60, 2), rss_kib(server.proc.pid)))
        if server.proc.poll() is not None:
            print("FAIL: the server exited during the soak", file=sys.stderr)
            break
        time.sleep(min(30, max(1, args.minutes * 60 / 60)))
    for t in threads:
        t.join(timeout=700)
    drained = server.wait_for_metric("tessera_kv_blocks_used", 0, timeout=60)
    kv_used = server.metric("tessera_kv_blocks_used")
    alive = server.proc.poll() is None
    exit_code = server.stop()

    per_minute = {}
    for minute, latency in stats.latencies:
        per_minute.setdefault(minute, []).append(latency)
    latency_rows = []
    for minute in sorted(per_minute):
        xs = sorted(per_minute[minute])
        latency_rows.append({"minute": minute, "requests": len(xs),
                             "p50_s": round(xs[len(xs) // 2], 3),
                             "p99_s": round(xs[min(len(xs) - 1, int(len(xs) * 0.99))], 3)})
    after_warmup = [kib for minute, kib in rss if minute >= args.warmup_minutes]
    report = {
        "clients": args.clients, "minutes": args.minutes, **stats.counts,
        "kv_blocks_used_at_end": kv_used, "server_alive_at_end": alive,
        "server_exit_code": exit_code,
        "rss_mib_after_warmup": {
            "first": round(after_warmup[0] / 1024, 1) if after_warmup else None,
            "last": round(after_warmup[-1] / 1024, 1) if after_warmup else None,
            "min": round(min(after_warmup) / 1024, 1) if after_warmup else None,
            "max": round(max(after_warmup) / 1024, 1) if after_warmup else None,
        },
        "rss_samples": rss, "latency_per_minute": latency_rows, "failures": stats.failures,
    }
    print(json.dumps({k: v for k, v in report.items() if k not in ("rss_samples",)}, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    ok = (stats.counts["failed"] == 0 and stats.counts["truncated"] == 0 and drained and
          kv_used == 0 and alive and exit_code == 0)
    if exit_code != 0:
        print("server stderr (last 30 lines):\n" + "".join(server.stderr_lines[-30:]), file=sys.stderr)
    print("soak:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
