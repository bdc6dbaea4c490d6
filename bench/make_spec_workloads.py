#!/usr/bin/env python3
"""Workloads for the speculative-decoding benchmark (docs/benchmarks.md).

  bench/make_spec_workloads.py --tessera build/bin/tessera -o bench/workloads

writes two JSONL workloads for `tessera bench ab configs/bench/spec-off.yaml
configs/bench/spec-ngram.yaml -w FILE`:

  spec-grounded.jsonl  input-grounded: repeat, rewrite, proofread or summarize a passage of
                       tests/fixtures/text/perplexity-en.txt (prompt lookup finds its drafts)
  spec-chat.jsonl      free chat: "Tell me about X" (few drafts match)

Prompts are chat-formatted for SmolLM2 and tokenized by `tessera tokenize --parse-special`,
so the control tokens are real tokens (`prompt_ids`). Every request has max_tokens 96 and
arrives at t = 0; the batch-1 configs run them one at a time.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import subprocess

ROOT = pathlib.Path(__file__).resolve().parent.parent
ASKS = ["Repeat the following text exactly.", "Rewrite the following text in plain words.",
        "Copy this paragraph, fixing any typos.", "Summarize the following text."]
TOPICS = ["the history of Rome", "how bees make honey", "a recipe for bread", "the rules of chess",
          "why the sky is blue", "sorting algorithms", "the water cycle", "how a bicycle works"]


def sentences() -> list[str]:
    text = (ROOT / "tests/fixtures/text/perplexity-en.txt").read_text().replace("\n", " ")
    out, cur = [], ""
    for c in text:
        cur += c
        if c == "." and len(cur) > 20:
            out.append(cur.strip())
            cur = ""
    return out


def user_messages(n: int) -> dict[str, list[str]]:
    """The n user messages of each workload, before the chat template (the peer script's
    `spec` comparison sends the same ones to llama.cpp)."""
    s = sentences()
    grounded = [f"{ASKS[i % len(ASKS)]}\n\n" + " ".join(s[(i * 3 + k) % len(s)] for k in range(3))
                for i in range(n)]
    return {"input-grounded": grounded, "chat": [f"Tell me about {TOPICS[i % len(TOPICS)]}." for i in range(n)]}


def chat(user: str) -> str:
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def tokenize(tessera: str, model: str, text: str) -> list[int]:
    out = subprocess.run([tessera, "tokenize", "-m", model, "--parse-special", "-t", text],
                         check=True, capture_output=True, text=True).stdout
    return [int(t) for t in out.split()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tessera", default=str(ROOT / "build/bin/tessera"))
    ap.add_argument("--model", default="smollm2-135m-instruct-q4_1")
    ap.add_argument("-n", type=int, default=8, help="requests per workload")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("-o", "--out-dir", default=str(ROOT / "bench/workloads"))
    args = ap.parse_args()
    messages = user_messages(args.n)
    grounded = [chat(m) for m in messages["input-grounded"]]
    free = [chat(m) for m in messages["chat"]]
    out_dir = pathlib.Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, prompts in (("spec-grounded", grounded), ("spec-chat", free)):
        with open(out_dir / f"{name}.jsonl", "w") as f:
            for i, p in enumerate(prompts):
                f.write(json.dumps({"id": f"{name}-{i}", "prompt_ids": tokenize(args.tessera, args.model, p),
                                    "max_tokens": args.max_tokens, "tag": name}) + "\n")
        print(f"wrote {out_dir / (name + '.jsonl')} ({len(prompts)} requests)")


if __name__ == "__main__":
    main()
