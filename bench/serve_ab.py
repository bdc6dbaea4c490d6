#!/usr/bin/env python3
"""Two Tessera stacks served to the same concurrent clients, rounds interleaved A B A B.

Each round starts a fresh `tessera serve` of each stack on loopback and drives it with
`tessera bench serve --concurrency N` on the peer script's serving workload (distinct
~128-token story prompts, `--out-tokens` each; `--prompt-repeat R` makes every prompt R times
longer, for long-context cases). The machine's speed drifts within minutes, so the ratio B / A
is taken per round (neighbouring runs) and the median over rounds is reported with every round.

  bench/serve_ab.py configs/smollm2-cpu.yaml configs/smollm2-cpu-q8kv.yaml --clients 16 -n 48 -r 3
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peer_llama_cpp import ROOT, bench_serve, free_port, stop, wait_healthy, write_serving_workload  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a", type=Path, help="stack A YAML")
    ap.add_argument("b", type=Path, help="stack B YAML")
    ap.add_argument("--tessera", type=Path, default=ROOT / "build/bin/tessera")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("-n", "--requests", type=int, default=48)
    ap.add_argument("--out-tokens", type=int, default=128)
    ap.add_argument("--prompt-repeat", type=int, default=1, help="each prompt this many times over")
    ap.add_argument("-r", "--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path, help="write every round's metrics here")
    args = ap.parse_args()

    results: dict[str, list[dict]] = {"A": [], "B": []}
    with tempfile.TemporaryDirectory() as tmp:
        workload = Path(tmp) / "serve.jsonl"
        write_serving_workload(workload, args.requests, args.out_tokens)
        if args.prompt_repeat > 1:
            lines = [json.loads(l) for l in workload.read_text().splitlines()]
            workload.write_text("".join(json.dumps(dict(l, prompt=" ".join([l["prompt"]] * args.prompt_repeat))) + "\n"
                                        for l in lines))
        for r in range(args.rounds):
            for name, config in (("A", args.a), ("B", args.b)):
                port = free_port()
                url = f"http://127.0.0.1:{port}"
                proc = subprocess.Popen([str(args.tessera), "serve", "--config", str(config), "--host", "127.0.0.1",
                                         "--port", str(port)], stdout=open(Path(tmp) / f"{name}.log", "w"),
                                        stderr=subprocess.STDOUT)
                try:
                    wait_healthy(url, proc)
                    results[name].append(bench_serve(args.tessera, url, workload, args.clients, args.requests))
                finally:
                    stop(proc)
                m = results[name][-1]
                print(f"round {r + 1} {name}: {m['output_tokens_per_s']:.1f} output t/s", file=sys.stderr, flush=True)
    ratios = [b["output_tokens_per_s"] / a["output_tokens_per_s"] for a, b in zip(results["A"], results["B"])]
    for name, config in (("A", args.a), ("B", args.b)):
        tps = [m["output_tokens_per_s"] for m in results[name]]
        print(f"{name} {config}: output t/s {statistics.median(tps):.1f} ({min(tps):.1f}-{max(tps):.1f})")
    print("B / A per round: " + ", ".join(f"{x:.3f}" for x in ratios) + f"; median {statistics.median(ratios):.3f}")
    if args.json:
        args.json.write_text(json.dumps({"a": str(args.a), "b": str(args.b), "rounds": results, "ratios": ratios}, indent=1))


if __name__ == "__main__":
    main()
