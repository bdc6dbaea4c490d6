#!/usr/bin/env python3
"""Load test for `tessera serve` (or any OpenAI-compatible server).

N concurrent clients each send streaming completion requests back to back for a duration.
Reports failed requests (non-200, connection errors) and truncated streams (no finish_reason
or no `data: [DONE]`), p50/p99 TTFT and TPOT, output-token throughput, the server's RSS over
time (from /proc/<pid>/status when --pid is given) and, at the end, KV blocks still in use from
/metrics.

  python3 bench/load_test.py --url http://127.0.0.1:8080 --clients 64 --duration 120 --pid $(pgrep -n tessera)
"""
import argparse
import asyncio
import json
import random
import re
import statistics
import sys
import time

import httpx

TOPICS = ["the ocean", "medieval castles", "how computers work", "bread baking", "the solar system",
          "honey bees", "mountain climbing", "jazz music", "ancient Rome", "rain forests", "chess openings",
          "volcanoes", "the printing press", "coral reefs", "electric cars", "origami"]


def percentile(values, p):
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def read_rss_mib(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


class Stats:
    def __init__(self):
        self.ok = 0
        self.failed = 0
        self.truncated = 0
        self.errors = {}
        self.ttft = []
        self.tpot = []
        self.output_tokens = 0
        self.rss = []  # (seconds since start, MiB)


async def one_request(client, args, stats, rng):
    topic = rng.choice(TOPICS)
    prompt = f"Write a few sentences about {topic}. Mention one surprising fact about {topic}."
    body = {"model": args.model, "prompt": prompt, "max_tokens": args.max_tokens, "temperature": args.temperature,
            "stream": True, "stream_options": {"include_usage": True}}
    if args.ignore_eos:
        body["ignore_eos"] = True
    if args.top_k is not None:
        body["top_k"] = args.top_k
    if args.top_p is not None:
        body["top_p"] = args.top_p
    if args.min_p is not None:
        body["min_p"] = args.min_p
    start = time.perf_counter()
    first = None
    last = None
    finish = None
    done = False
    usage = None
    try:
        async with client.stream("POST", args.url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                stats.failed += 1
                key = f"HTTP {r.status_code}"
                stats.errors[key] = stats.errors.get(key, 0) + 1
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for c in chunk.get("choices", []):
                    now = time.perf_counter()
                    if c.get("text"):
                        if first is None:
                            first = now
                        last = now
                    if c.get("finish_reason"):
                        finish = c["finish_reason"]
    except (httpx.HTTPError, OSError) as e:
        stats.failed += 1
        key = type(e).__name__
        stats.errors[key] = stats.errors.get(key, 0) + 1
        return
    if not done or finish is None:
        stats.truncated += 1
        return
    stats.ok += 1
    n = usage["completion_tokens"] if usage else 0
    stats.output_tokens += n
    if first is not None:
        stats.ttft.append(first - start)
        if n > 1 and last is not None and last > first:
            stats.tpot.append((last - first) / (n - 1))


async def client_loop(i, client, args, stats, deadline):
    rng = random.Random(i)
    while time.perf_counter() < deadline:
        await one_request(client, args, stats, rng)


async def sample_rss(args, stats, start, deadline):
    while time.perf_counter() < deadline:
        rss = read_rss_mib(args.pid)
        if rss is not None:
            stats.rss.append((time.perf_counter() - start, rss))
        await asyncio.sleep(args.rss_interval)


async def kv_blocks_used(client, args):
    r = await client.get(args.url + "/metrics")
    m = re.search(r"^tessera_kv_blocks_used (\S+)$", r.text, re.M)
    return float(m.group(1)) if m else None


async def main_async(args):
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.clients + 4, max_keepalive_connections=args.clients + 4)
    timeout = httpx.Timeout(args.request_timeout)
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=timeout) as client:
        if not args.model:
            args.model = (await client.get(args.url + "/v1/models")).json()["data"][0]["id"]
        stats = Stats()
        start = time.perf_counter()
        deadline = start + args.duration
        tasks = [asyncio.create_task(client_loop(i, client, args, stats, deadline)) for i in range(args.clients)]
        if args.pid:
            tasks.append(asyncio.create_task(sample_rss(args, stats, start, deadline)))
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - start
        # Requests still finishing at the deadline ran to completion above; give the engine a
        # moment to free the last blocks before reading the gauge.
        blocks = None
        for _ in range(50):
            blocks = await kv_blocks_used(client, args)
            if blocks == 0:
                break
            await asyncio.sleep(0.1)
        if args.pid:
            rss = read_rss_mib(args.pid)
            if rss is not None:
                stats.rss.append((time.perf_counter() - start, rss))
    return stats, elapsed, blocks


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--duration", type=float, default=120, help="seconds")
    ap.add_argument("--model", default="", help="default: the first of /v1/models")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--top-k", type=int, default=None, help="sent when given (a llama.cpp/vLLM extension)")
    ap.add_argument("--top-p", type=float, default=None, help="sent when given")
    ap.add_argument("--min-p", type=float, default=None, help="sent when given (a llama.cpp/vLLM extension)")
    ap.add_argument("--ignore-eos", action="store_true", help="always generate max_tokens")
    ap.add_argument("--api-key", default="")
    ap.add_argument("--pid", type=int, default=0, help="server process id, for RSS over time")
    ap.add_argument("--rss-interval", type=float, default=10)
    ap.add_argument("--warmup", type=float, default=30, help="seconds before RSS must stay flat")
    ap.add_argument("--request-timeout", type=float, default=600)
    ap.add_argument("--json", default="", help="also write the summary to this file")
    args = ap.parse_args()

    stats, elapsed, blocks = asyncio.run(main_async(args))
    total = stats.ok + stats.failed + stats.truncated
    summary = {
        "clients": args.clients, "duration_s": round(elapsed, 1), "requests": total, "ok": stats.ok,
        "failed": stats.failed, "truncated": stats.truncated, "errors": stats.errors,
        "ttft_p50_s": percentile(stats.ttft, 50), "ttft_p99_s": percentile(stats.ttft, 99),
        "tpot_p50_s": percentile(stats.tpot, 50), "tpot_p99_s": percentile(stats.tpot, 99),
        "output_tokens": stats.output_tokens, "output_tokens_per_s": stats.output_tokens / elapsed,
        "requests_per_s": stats.ok / elapsed, "kv_blocks_used_at_end": blocks,
    }
    print(f"{args.clients} clients for {elapsed:.0f} s against {args.url} (model {args.model}, "
          f"max_tokens {args.max_tokens})")
    print(f"requests: {total} ({stats.ok} ok, {stats.failed} failed, {stats.truncated} truncated)"
          + (f" errors: {stats.errors}" if stats.errors else ""))
    print(f"TTFT  p50 {summary['ttft_p50_s'] * 1e3:.0f} ms  p99 {summary['ttft_p99_s'] * 1e3:.0f} ms")
    print(f"TPOT  p50 {summary['tpot_p50_s'] * 1e3:.1f} ms  p99 {summary['tpot_p99_s'] * 1e3:.1f} ms")
    print(f"throughput: {summary['output_tokens_per_s']:.1f} output tokens/s, {summary['requests_per_s']:.2f} requests/s")
    if stats.rss:
        print("server RSS (MiB) over time: " + ", ".join(f"{t:.0f}s {m:.0f}" for t, m in stats.rss))
        after = [m for t, m in stats.rss if t >= args.warmup]
        if len(after) >= 2:
            summary["rss_after_warmup_mib"] = [min(after), max(after)]
            print(f"RSS after {args.warmup:.0f} s warm-up: min {min(after):.0f} MiB, max {max(after):.0f} MiB "
                  f"(growth {max(after) - after[0]:+.0f} MiB)")
        summary["rss_mib"] = stats.rss
    print(f"KV blocks in use at the end: {blocks}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    bad = stats.failed + stats.truncated > 0 or (blocks is not None and blocks != 0)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
