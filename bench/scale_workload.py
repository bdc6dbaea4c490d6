#!/usr/bin/env python3
"""Shrinks a `tessera bench` workload JSONL while keeping its shape: prompt token ids and
output lengths divided (rounded up), optionally only for requests of one tag. Used to fit
the issue-3 benchmarks into minutes on a contended 2-core machine; the full-size commands
are in docs/benchmarks.md.

  bench/scale_workload.py IN.jsonl OUT.jsonl --prompt-div 4 --output-div 4 [--tag decode]
"""
import argparse
import json
import math

ap = argparse.ArgumentParser()
ap.add_argument("input")
ap.add_argument("output")
ap.add_argument("--prompt-div", type=float, default=1)
ap.add_argument("--output-div", type=float, default=1)
ap.add_argument("--tag", help="scale only the requests with this tag")
args = ap.parse_args()

with open(args.input) as f, open(args.output, "w") as out:
    for line in f:
        if not line.strip():
            continue
        r = json.loads(line)
        if args.tag is None or r.get("tag") == args.tag:
            if args.prompt_div != 1:
                ids = r["prompt_ids"]
                r["prompt_ids"] = ids[:max(1, math.ceil(len(ids) / args.prompt_div))]
                r.pop("prompt", None)  # the text no longer matches the ids
            r["max_tokens"] = max(1, math.ceil(r["max_tokens"] / args.output_div))
        out.write(json.dumps(r) + "\n")
