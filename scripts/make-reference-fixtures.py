#!/usr/bin/env python3
"""Writes the llama.cpp reference fixtures the test suite compares Tessera against.

Runs llama-cpp-python (PyPI: llama-cpp-python, which builds llama.cpp) on the same GGUF file
and records, for each prompt: its token ids, the logits at the last prompt position, and the
greedy continuation of 64 tokens (end-of-generation tokens ignored so both sides produce 64),
each step evaluated as one batch over the whole sequence so far.
The output is committed, so CI needs no llama.cpp.

    pip install llama-cpp-python numpy
    scripts/make-reference-fixtures.py [--model FILE.gguf] [--out tests/fixtures/reference]

Reference settings (recorded in the JSON): KV cache f32 (type_k = type_v = 0), flash attention
off, 2 threads, n_ctx 2048. With an f32 cache llama.cpp's x86 CPU path and Tessera's gguf
quantizer + naive attention compute the same floats in the same order, so the logits agree
to the last bit; with llama.cpp's default f16 cache they still round differently.
"""
import argparse
import json
import os
import pathlib
import sys

import numpy as np

PROMPTS = [
    # (name, text, parse_special)
    ("plain-en", "The capital of France is", False),
    ("chat", "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
             "<|im_start|>user\nWhat is the tallest mountain in the world?<|im_end|>\n<|im_start|>assistant\n", True),
    ("code-python", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n", False),
    ("french-accents", "Les élèves étudient à l'université de Genève, où il fait très froid en hiver. Ils", False),
    ("cjk-emoji", "東京は日本の首都です。🗼 The Tokyo Tower is", False),
    ("story", "Once upon a time, in a small village by the sea,", False),
    ("numbers", "List of prime numbers: 2, 3, 5, 7, 11,", False),
    ("russian", "Москва — столица России. Население Москвы", False),
    ("code-cpp", "#include <vector>\n\n// Returns the sum of all elements.\nint sum(const std::vector<int>& v) {\n", False),
]
NUM_GREEDY = 64


def main():
    default_model = os.path.join(os.environ.get("TESSERA_MODEL_DIR", os.path.expanduser("~/.cache/tessera/models")),
                                 "SmolLM2-135M-Instruct.Q4_1.gguf")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=default_model)
    ap.add_argument("--out", default=str(pathlib.Path(__file__).resolve().parent.parent / "tests/fixtures/reference"))
    ap.add_argument("--name", default="smollm2-135m-instruct-q4_1")
    args = ap.parse_args()

    import llama_cpp
    from llama_cpp import Llama

    llm = Llama(model_path=args.model, n_ctx=2048, n_threads=2, logits_all=True, verbose=False,
                flash_attn=False, type_k=0, type_v=0)
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    logits_path = out_dir / f"{args.name}.logits.f32"
    records = []
    with open(logits_path, "wb") as logits_file:
        for name, text, parse_special in PROMPTS:
            ids = llm.tokenize(text.encode("utf-8"), add_bos=True, special=parse_special)
            llm.reset()
            llm.eval(ids)
            last = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
            logits_file.write(last.astype("<f4").tobytes())
            # Each next token comes from evaluating the whole sequence as one batch: llama.cpp's
            # one-token decode path takes other kernels (tinyBLAS for Q.K) and rounds
            # differently from its own batch evaluation (measured: up to 0.35 in a logit), while
            # the batch numerics are the same for every position, as Tessera's are.
            greedy = []
            for _ in range(NUM_GREEDY):
                token = int(np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32).argmax())
                greedy.append(token)
                llm.reset()
                llm.eval(ids + greedy)
            records.append({
                "name": name,
                "text": text,
                "parse_special": parse_special,
                "prompt_ids": ids,
                "greedy_ids": greedy,
                "logits_range": [float(last.min()), float(last.max())],
            })
            print(f"{name}: {len(ids)} prompt tokens, greedy: {llm.detokenize(greedy)[:60]!r}", file=sys.stderr)
    meta = {
        "model_file": os.path.basename(args.model),
        "reference": f"llama-cpp-python {llama_cpp.__version__}",
        "settings": {"n_ctx": 2048, "kv_cache": "f32", "flash_attn": False, "n_threads": 2},
        "vocab_size": llm.n_vocab(),
        "logits_file": logits_path.name,
        "num_greedy_tokens": NUM_GREEDY,
        "prompts": records,
    }
    (out_dir / f"{args.name}.json").write_text(json.dumps(meta, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {out_dir / (args.name + '.json')} and {logits_path}", file=sys.stderr)


if __name__ == "__main__":
    main()
