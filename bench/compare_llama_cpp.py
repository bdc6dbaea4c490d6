#!/usr/bin/env python3
"""Batch-1 generation speed of `tessera generate` beside llama-cpp-python, in one run.

Both load the same GGUF, use 2 threads, and generate 128 greedy tokens after the same prompt
(end-of-generation ignored). Runs alternate (tessera, llama.cpp, tessera, ...) so drift in the
machine's load hits both; the median of the runs is reported.

    pip install llama-cpp-python numpy
    bench/compare_llama_cpp.py [--runs 3] [--tokens 128]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def run_tessera(binary, config, tokens):
    out = subprocess.run([binary, "generate", "--config", config, "--json", "--prompt", PROMPT,
                          "--temperature", "0", "--max-tokens", str(tokens), "--ignore-eos"],
                         check=True, capture_output=True, text=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    t = result["timings"]
    n_prompt = len(result["prompt_tokens"])
    return {"prompt_tokens": n_prompt, "ttft_s": t["ttft_s"],
            "decode_tps": 1.0 / t["tpot_s"], "tokens": result["tokens"]}


def run_llama_cpp(llm, tokens):
    ids = llm.tokenize(PROMPT.encode(), add_bos=True, special=False)
    llm.reset()
    start = time.perf_counter()
    llm.eval(ids)
    out = []
    token = int(llm.scores[llm.n_tokens - 1].argmax())
    first = time.perf_counter()
    out.append(token)
    for _ in range(tokens - 1):
        llm.eval([token])
        token = int(llm.scores[llm.n_tokens - 1].argmax())
        out.append(token)
    end = time.perf_counter()
    return {"prompt_tokens": len(ids), "ttft_s": first - start,
            "decode_tps": (tokens - 1) / (end - first), "tokens": out}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--binary", default=os.path.join(ROOT, "build/bin/tessera"))
    ap.add_argument("--config", default=os.path.join(ROOT, "configs/smollm2-cpu.yaml"))
    ap.add_argument("--model", default=os.path.join(os.environ.get(
        "TESSERA_MODEL_DIR", os.path.expanduser("~/.cache/tessera/models")), "SmolLM2-135M-Instruct.Q4_1.gguf"))
    args = ap.parse_args()

    import llama_cpp
    from llama_cpp import Llama
    llm = Llama(model_path=args.model, n_ctx=2048, n_threads=2, logits_all=True, verbose=False)
    results = {"tessera": [], "llama.cpp": []}
    for i in range(args.runs):
        results["tessera"].append(run_tessera(args.binary, args.config, args.tokens))
        results["llama.cpp"].append(run_llama_cpp(llm, args.tokens))
        print(f"run {i + 1}/{args.runs}: tessera {results['tessera'][-1]['decode_tps']:.1f} t/s, "
              f"llama.cpp {results['llama.cpp'][-1]['decode_tps']:.1f} t/s", file=sys.stderr)
    print(f"llama-cpp-python {llama_cpp.__version__}; {args.runs} runs, {args.tokens} greedy tokens, 2 threads")
    print(f"{'':12} {'decode t/s (median)':>20} {'TTFT ms (median)':>18} {'prompt tokens':>14}")
    for name, rs in results.items():
        print(f"{name:12} {statistics.median(r['decode_tps'] for r in rs):20.1f} "
              f"{1000 * statistics.median(r['ttft_s'] for r in rs):18.1f} {rs[0]['prompt_tokens']:14d}")
    ratio = statistics.median(r["decode_tps"] for r in results["tessera"]) / statistics.median(
        r["decode_tps"] for r in results["llama.cpp"])
    print(f"decode ratio tessera / llama.cpp: {ratio:.2f}")


if __name__ == "__main__":
    main()
