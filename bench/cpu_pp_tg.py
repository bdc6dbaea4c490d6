#!/usr/bin/env python3
"""pp512 / tg128 of `tessera generate` beside llama-cpp-python (and optionally a second Tessera
binary, e.g. a build of the previous commit), interleaved in one run, 2 threads, same GGUF.

pp: a prompt of ~512 tokens evaluated in one batch; prompt tokens / time to first token.
tg: 128 (--tg-tokens) greedy tokens at batch 1 (end-of-generation ignored); 1 / mean time per output token.
llama.cpp: llm.eval() of the same number of prompt tokens, then 128 single-token evals.

    bench/cpu_pp_tg.py [--runs 3] [--binary build/bin/tessera] [--baseline OTHER/bin/tessera]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEED_TEXT = ("The lighthouse keeper climbed the spiral stairs every evening, counting the steps "
             "and listening to the sea against the rocks below. ")


def tessera_run(binary, config, prompt, max_tokens):
    out = subprocess.run([binary, "generate", "--config", config, "--json", "--prompt", prompt,
                          "--temperature", "0", "--max-tokens", str(max_tokens), "--ignore-eos"],
                         check=True, capture_output=True, text=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    return len(r["prompt_tokens"]), r["timings"]


def llama_pp(llm, ids):
    llm.reset()
    start = time.perf_counter()
    llm.eval(ids)
    return len(ids) / (time.perf_counter() - start)


def llama_tg(llm, ids, tokens):
    llm.reset()
    llm.eval(ids)
    token = int(llm.scores[llm.n_tokens - 1].argmax())
    start = time.perf_counter()
    for _ in range(tokens):
        llm.eval([token])
        token = int(llm.scores[llm.n_tokens - 1].argmax())
    return tokens / (time.perf_counter() - start)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--binary", default=os.path.join(ROOT, "build/bin/tessera"))
    ap.add_argument("--baseline", default=None, help="a second tessera binary to interleave")
    ap.add_argument("--config", default=os.path.join(ROOT, "configs/smollm2-cpu.yaml"))
    ap.add_argument("--no-llama", action="store_true")
    ap.add_argument("--tg-tokens", type=int, default=128)
    ap.add_argument("--model", default=os.path.join(os.environ.get(
        "TESSERA_MODEL_DIR", os.path.expanduser("~/.cache/tessera/models")), "SmolLM2-135M-Instruct.Q4_1.gguf"))
    args = ap.parse_args()

    llm = None
    if not args.no_llama:
        from llama_cpp import Llama
        llm = Llama(model_path=args.model, n_ctx=2048, n_threads=2, n_threads_batch=2,
                    n_batch=512, n_ubatch=512, logits_all=False, verbose=False)
    # A prompt of 511 tokens (+ BOS = 512) by the model's own tokenizer.
    text = SEED_TEXT * 40
    if llm is not None:
        ids = llm.tokenize(text.encode(), add_bos=False, special=False)[:511]
        text = llm.detokenize(ids).decode()
    short = "Write a short story about a lighthouse keeper who finds a message in a bottle."

    arms = {"tessera": args.binary}
    if args.baseline:
        arms["baseline"] = args.baseline
    res = {k: {"pp": [], "tg": []} for k in list(arms) + (["llama.cpp"] if llm else [])}
    n_pp = None
    for i in range(args.runs):
        for name, binary in arms.items():
            n_pp, t = tessera_run(binary, args.config, text, 1)
            res[name]["pp"].append(n_pp / t["ttft_s"])
            _, t = tessera_run(binary, args.config, short, args.tg_tokens)
            res[name]["tg"].append(1.0 / t["tpot_s"])
        if llm is not None:
            ids = llm.tokenize(text.encode(), add_bos=True, special=False)
            res["llama.cpp"]["pp"].append(llama_pp(llm, ids))
            res["llama.cpp"]["tg"].append(
                llama_tg(llm, llm.tokenize(short.encode(), add_bos=True, special=False), args.tg_tokens))
        print(f"run {i + 1}/{args.runs}: " + ", ".join(
            f"{k} pp {v['pp'][-1]:.1f} tg {v['tg'][-1]:.1f}" for k, v in res.items()), file=sys.stderr)
    print(f"{args.runs} interleaved runs, 2 threads, pp = {n_pp} prompt tokens in one batch, tg = {args.tg_tokens} tokens")
    print(f"{'':10} {'pp t/s median':>14} {'(min..max)':>16} {'tg t/s median':>14} {'(min..max)':>16}")
    for k, v in res.items():
        print(f"{k:10} {statistics.median(v['pp']):14.1f} {min(v['pp']):7.1f}..{max(v['pp']):<7.1f} "
              f"{statistics.median(v['tg']):14.1f} {min(v['tg']):7.1f}..{max(v['tg']):<7.1f}")
    if llm is not None:
        for k in arms:
            print(f"{k} / llama.cpp: pp {statistics.median(res[k]['pp']) / statistics.median(res['llama.cpp']['pp']):.2f}x, "
                  f"tg {statistics.median(res[k]['tg']) / statistics.median(res['llama.cpp']['tg']):.2f}x")


if __name__ == "__main__":
    main()
