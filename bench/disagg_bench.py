#!/usr/bin/env python3
"""Colocated (chunked prefill) vs disaggregated (1 prefill + 1 decode process) on a
long-prompt workload, on this machine's cores.

Each arm gets the same cores: colocated runs one process with --threads T; disaggregated runs
a prefill process and a decode process with T/2 threads each (default T=2). C clients stream
completions back to back for D seconds; each prompt is ~P tokens, unique (a numbered header),
so no prefix-cache hit hides the prefill. Reports TTFT p50/p99, ITL p99, output tok/s,
goodput (requests/s meeting TTFT <= --slo-ttft and ITL p99 <= --slo-itl), the gap from the
first to the second token (where the transfer shows on a disaggregated arm) and, for the
disaggregated arms, KV bytes and transfer time per request from the decode process's /metrics.
Two disaggregated arms: "pipelined" (the default: decoding starts once the first KV layer
landed, each layer awaited inside the forward) and "wait" (disaggregation.pipelined_start:
false: decoding starts once the last layer landed).

  python3 bench/disagg_bench.py --clients 4 --duration 60 --prompt-tokens 1000 --max-tokens 64
"""
import argparse
import json
import os
import re
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "integration"))
import server_harness as h  # noqa: E402
from load_test import percentile as pct  # noqa: E402  (bench/, this script's folder)

MODEL = "smollm2-135m-instruct-q4_1"
WORDS = ("river stone lantern orchard copper meadow harbor candle violet thunder ember willow "
         "granite falcon saffron glacier").split()


def prompt(i, n_tokens):
    # ~1.3 tokens per word for these words; the header makes every prompt unique.
    words = [WORDS[(i * 7 + k) % len(WORDS)] for k in range(int(n_tokens / 1.3))]
    return f"Request {i}. Read the list and name the most frequent word.\n" + " ".join(words) + "\nAnswer:"


def run_load(url, args):
    import httpx
    results, lock = [], threading.Lock()
    stop_at = time.time() + args.duration
    counter = [0]

    def client(cid):
        with httpx.Client(timeout=300) as http:
            while time.time() < stop_at:
                with lock:
                    counter[0] += 1
                    i = counter[0] * 100 + cid
                body = {"model": MODEL, "prompt": prompt(i, args.prompt_tokens), "max_tokens": args.max_tokens,
                        "temperature": 0, "stream": True, "ignore_eos": True}
                t0 = time.time()
                times = []
                with http.stream("POST", url + "/v1/completions", json=body) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            ev = json.loads(line[6:])
                            if ev.get("choices") and ev["choices"][0].get("text"):
                                times.append(time.time())
                if times:
                    itl = [b - a for a, b in zip(times, times[1:])]
                    with lock:
                        results.append({"ttft": times[0] - t0, "itl": itl, "tokens": len(times),
                                        "end": times[-1] - t0})

    threads = [threading.Thread(target=client, args=(c,)) for c in range(args.clients)]
    t_start = time.time()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.time() - t_start
    ttft = [r["ttft"] for r in results]
    second = [r["itl"][0] for r in results if r["itl"]]
    itl_all = [x for r in results for x in r["itl"]]
    good = [r for r in results if r["ttft"] <= args.slo_ttft and (not r["itl"] or pct(r["itl"], 99) <= args.slo_itl)]
    return {"requests": len(results), "wall_s": wall, "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99),
            "itl_p50": pct(itl_all, 50), "itl_p99": pct(itl_all, 99),
            "second_token_p50": pct(second, 50), "second_token_p99": pct(second, 99),
            "out_tok_s": sum(r["tokens"] for r in results) / wall, "goodput_rps": len(good) / wall,
            "good_share": len(good) / max(1, len(results))}


def labelled(server, name):
    m = re.search(rf'^{re.escape(name)}{{deployment="{MODEL}"}} ([-+\d.e]+)$', server.metrics(), re.M)
    return float(m.group(1)) if m else 0.0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--duration", type=float, default=60)
    ap.add_argument("--prompt-tokens", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2, help="cores per arm (disaggregated: half each)")
    ap.add_argument("--slo-ttft", type=float, default=3.0, help="seconds")
    ap.add_argument("--slo-itl", type=float, default=0.25, help="seconds (a request's ITL p99)")
    ap.add_argument("--arms", default="colocated,pipelined,wait",
                    help="comma-separated: colocated, pipelined (disaggregated), wait (disaggregated, "
                         "pipelined_start: false)")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    h.require_environment(("httpx",))
    half = max(1, args.threads // 2)
    out = {"args": vars(args)}

    if "colocated" in arms:
        colo = h.Gateway(f"extends: {h.DEFAULT_STACK}\nmodel: {{threads: {args.threads}}}\n", "bench-colocated").start()
        try:
            out["colocated"] = run_load(colo.url, args)
        finally:
            colo.stop()

    for arm in ("pipelined", "wait"):
        if arm not in arms:
            continue
        prefill = h.Gateway(f"extends: {h.DEFAULT_STACK}\nmodel: {{threads: {half}}}\n"
                            "disaggregation: {role: prefill, connector: {plugin: grpc}, listen: 127.0.0.1:0}\n",
                            f"bench-prefill-{arm}").start()
        port = None
        deadline = time.time() + 10
        while port is None and time.time() < deadline:
            for line in prefill.stderr_lines:
                m = re.search(r"127\.0\.0\.1:(\d+) serves", line)
                if m:
                    port = int(m.group(1))
            time.sleep(0.05)
        pipelined = "true" if arm == "pipelined" else "false"
        decode = h.Gateway(f"extends: {h.DEFAULT_STACK}\nmodel: {{threads: {half}}}\n"
                           f"disaggregation: {{role: decode, connector: {{plugin: grpc}}, prefill: [127.0.0.1:{port}], "
                           f"pipelined_start: {pipelined}}}\n",
                           f"bench-decode-{arm}").start()
        try:
            d = run_load(decode.url, args)
            n = max(1.0, labelled(decode, "tessera_disagg_remote_prefills_total"))
            d["kv_bytes_per_request"] = labelled(decode, "tessera_disagg_kv_bytes_total") / n
            d["transfer_ms_per_request"] = labelled(decode, "tessera_disagg_transfer_seconds_total") / n * 1e3
            d["remote_prefill_ms_per_request"] = labelled(decode, "tessera_disagg_prefill_seconds_total") / n * 1e3
            d["local_prefills"] = labelled(decode, "tessera_disagg_local_prefills_total")
            d["pipelined_starts"] = labelled(decode, "tessera_kv_transfer_pipelined_starts_total")
            d["layer_wait_ms_per_request"] = labelled(decode, "tessera_kv_transfer_layer_wait_seconds_total") / n * 1e3
            out[arm] = d
        finally:
            decode.stop()
            prefill.stop()

    print(f"{args.clients} clients, {args.duration:.0f} s, ~{args.prompt_tokens}-token prompts, {args.max_tokens} "
          f"output tokens, {args.threads} cores per arm; SLO TTFT <= {args.slo_ttft} s, ITL p99 <= {args.slo_itl} s")
    print("| arm | requests | TTFT p50 | TTFT p99 | 2nd token p50 / p99 | ITL p50 | ITL p99 | out tok/s | "
          "goodput req/s (share) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for arm in arms:
        r = out[arm]
        print(f"| {arm} | {r['requests']} | {r['ttft_p50']:.3f} s | {r['ttft_p99']:.3f} s | "
              f"{r['second_token_p50'] * 1e3:.1f} / {r['second_token_p99'] * 1e3:.1f} ms | {r['itl_p50'] * 1e3:.1f} ms "
              f"| {r['itl_p99'] * 1e3:.1f} ms | {r['out_tok_s']:.1f} | {r['goodput_rps']:.3f} ({r['good_share']:.0%}) |")
    for arm in ("pipelined", "wait"):
        if arm in out:
            d = out[arm]
            print(f"{arm}: {d['kv_bytes_per_request'] / 2**20:.2f} MiB of KV per request, transfer "
                  f"{d['transfer_ms_per_request']:.2f} ms, remote prefill call {d['remote_prefill_ms_per_request']:.1f} ms "
                  f"per request, {d['local_prefills']:.0f} local fallbacks, {d['pipelined_starts']:.0f} steps started "
                  f"before the last layer, {d['layer_wait_ms_per_request']:.2f} ms waited for layers per request")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
