#!/usr/bin/env python3
"""What an open /dashboard costs the server: `tessera bench serve` at 16 clients, in
interleaved rounds without and with a poller that does what the page does (GET /v1/stats
every 2 s, the roofline every 30 s).

    python3 bench/dashboard_cost.py [--rounds 3] [-n 32] [--config configs/smollm2-cpu.yaml] [--model ab]

Starts its own `tessera serve` (port 0), makes one workload (`bench make-workload`), runs a
warm-up round, then rounds in the order off,on / on,off / off,on ... and prints every
round's output tokens/s and the server's CPU seconds per completed request (utime + stime
of the server process over the round, from /proc), the ratios of the medians and each
pair's ratio. CPU per request is the robust figure on a shared machine: other processes
stretch a round's wall time (and so tokens/s) far more than the CPU the server spends on
it. Nothing here is asserted: the spread between rounds is the figure to read first.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tessera", default=os.path.join(ROOT, "build", "bin", "tessera"))
    ap.add_argument("--config", default=os.path.join(ROOT, "configs", "smollm2-cpu.yaml"))
    ap.add_argument("--rounds", type=int, default=3, help="pairs of (off, on) rounds")
    ap.add_argument("-n", "--num-requests", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--poll", type=float, default=2.0, help="seconds between /v1/stats polls")
    ap.add_argument("--model", help="the model id to load (default: the first of /v1/models), e.g. a router")
    ap.add_argument("--json", help="write every round to this file")
    args = ap.parse_args()

    work = tempfile.mkdtemp(prefix="tessera-dashboard-cost-")
    workload = os.path.join(work, "work.jsonl")
    subprocess.run([args.tessera, "bench", "make-workload", "-c", args.config, "--kind", "uniform-output",
                    "-n", str(args.num_requests), "-o", workload], check=True)

    server = subprocess.Popen([args.tessera, "serve", "-c", args.config, "--port", "0"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    port = None
    for line in server.stderr:
        m = re.search(r"listening on http://[\d.]+:(\d+)", line)
        if m:
            port = int(m.group(1))
            break
    if port is None:
        sys.exit("the server did not start")
    threading.Thread(target=lambda: [None for _ in server.stderr], daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    with urllib.request.urlopen(url + "/v1/models") as r:
        model = args.model or json.load(r)["data"][0]["id"]
    print(f"start {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} UTC, load average "
          + " ".join(f"{x:.2f}" for x in os.getloadavg()), flush=True)

    polls = {"n": 0, "bytes": 0, "seconds": 0.0}

    def poller(stop):
        with urllib.request.urlopen(url + "/dashboard") as r:
            r.read()
        last_roof = -1e9
        while not stop.is_set():
            t0 = time.monotonic()
            roof = "&roofline=1" if t0 - last_roof > 30 else ""
            with urllib.request.urlopen(f"{url}/v1/stats?window=300{roof}") as r:
                body = r.read()
            if roof:
                last_roof = t0
            polls["n"] += 1
            polls["bytes"] += len(body)
            polls["seconds"] += time.monotonic() - t0
            stop.wait(args.poll)

    def server_cpu_seconds():
        with open(f"/proc/{server.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def round_(label, with_poller):
        out = os.path.join(work, f"{label}.json")
        stop = threading.Event()
        t = threading.Thread(target=poller, args=(stop,), daemon=True) if with_poller else None
        if t:
            t.start()
        cpu0 = server_cpu_seconds()
        subprocess.run([args.tessera, "bench", "serve", "--url", url, "--model", model, "-w", workload,
                        "--concurrency", str(args.concurrency), "--json", out],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        cpu = server_cpu_seconds() - cpu0
        stop.set()
        if t:
            t.join()
        with open(out) as f:
            m = json.load(f)["levels"][0]["metrics"]
        m["server_cpu_s"] = cpu
        m["server_cpu_ms_per_request"] = cpu / max(1, m["completed"]) * 1e3
        print(f"{label:>10}  poller {'on ' if with_poller else 'off'}  {m['output_tokens_per_s']:7.1f} tok/s  "
              f"CPU {m['server_cpu_ms_per_request']:6.1f} ms/request  load {os.getloadavg()[0]:.1f}  "
              f"TTFT p50 {m['ttft_p50_ms']:7.1f} ms  TPOT p50 {m['tpot_p50_ms']:6.1f} ms  "
              f"{m['completed']}/{m['requests']} ok  ({time.strftime('%H:%M:%S', time.gmtime())} UTC)", flush=True)
        return {"label": label, "poller": with_poller, **m}

    def cpu_per_poll(n=300):
        """Server CPU seconds per /v1/stats?window=300 reply, the server otherwise idle."""
        idle0 = server_cpu_seconds()
        time.sleep(3)
        idle = (server_cpu_seconds() - idle0) / 3  # the idle server's own CPU per second
        c0, t0 = server_cpu_seconds(), time.monotonic()
        for _ in range(n):
            with urllib.request.urlopen(f"{url}/v1/stats?window=300") as r:
                r.read()
        used = server_cpu_seconds() - c0 - idle * (time.monotonic() - t0)
        return used / n

    try:
        round_("warm-up", False)
        rounds = []
        for r in range(args.rounds):
            order = [False, True] if r % 2 == 0 else [True, False]
            for on in order:
                rounds.append(round_(f"round {r + 1}", on))
        per_poll = cpu_per_poll()
        print(f"server CPU per /v1/stats reply (window 300 s, after the rounds): {per_poll * 1e3:.2f} ms "
              f"= {per_poll / args.poll * 100:.3f}% of one core at one poll per {args.poll:g} s")
    finally:
        server.terminate()
        server.wait(60)

    for key, name in [("output_tokens_per_s", "tok/s"), ("server_cpu_ms_per_request", "server CPU ms/request")]:
        off = [x[key] for x in rounds if not x["poller"]]
        on = [x[key] for x in rounds if x["poller"]]
        pairs = [b / a for a, b in zip(off, on)]
        print(f"median {name}: off {statistics.median(off):.2f}, on {statistics.median(on):.2f}; "
              f"on/off = {statistics.median(on) / statistics.median(off):.4f}; per pair: "
              + ", ".join(f"{p:.4f}" for p in pairs))
    print(f"end {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} UTC, load average "
          + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    if polls["n"]:
        print(f"polls: {polls['n']}, mean reply {polls['bytes'] / polls['n'] / 1024:.1f} KiB, "
              f"mean client-side time {polls['seconds'] / polls['n'] * 1e3:.1f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rounds": rounds, "polls": polls, "server_cpu_s_per_poll": per_poll}, f, indent=1)


if __name__ == "__main__":
    main()
