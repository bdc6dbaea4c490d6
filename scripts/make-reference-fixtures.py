#!/usr/bin/env python3
"""Writes the llama.cpp reference fixtures the test suite compares Tessera against.

Runs llama-cpp-python (PyPI: llama-cpp-python, which builds llama.cpp) on the same GGUF file
and records, for each prompt: its token ids, the logits at the last prompt position, and the
greedy continuation of 64 tokens (end-of-generation tokens ignored so both sides produce 64),
each step evaluated as one batch over the whole sequence so far.
The output is committed, so CI needs no llama.cpp.

    pip install llama-cpp-python numpy
    scripts/make-reference-fixtures.py [--model FILE.gguf] [--out tests/fixtures/reference]
    scripts/make-reference-fixtures.py --model ~/.cache/tessera/models/gemma-3-270m-q4_k_m.gguf \
        --name gemma-3-270m-q4_k_m --prompts gemma --n-ctx 1024 --last-logits-only --threads 1

The llama.cpp build beside a llama-cpp-python source tree serves as well as the wheel:
LLAMA_CPP_LIB_PATH=<build>/bin PYTHONPATH=<source> (llama_cpp loads libllama.so from there).

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
# Gemma 3: its own chat markup, and a prompt longer than its 512-token sliding window so the
# local layers' window is exercised (the fixture's last-position logits and continuation
# differ from full attention's).
LONG_TEXT = "Notes from the lab book.\n" + "".join(
    f"Line {i}: the square of {i} is {i * i}, and {i} plus {i + 7} is {2 * i + 7}.\n" for i in range(1, 20))
GEMMA_KEEP = ("plain-en", "code-python", "french-accents", "cjk-emoji", "numbers", "code-cpp")
GEMMA_PROMPTS = [p for p in PROMPTS if p[0] in GEMMA_KEEP] + [
    ("chat", "<start_of_turn>user\nWhat is the tallest mountain in the world?<end_of_turn>\n"
             "<start_of_turn>model\n", True),
    ("long-window", LONG_TEXT + "Line 20: the square of 20 is", False),
]
NUM_GREEDY = 64
# name: (prompts, greedy tokens per prompt, greedy tokens for "long-window"). Every greedy
# step re-evaluates the whole sequence, which for Gemma's 262k-vocabulary model on a busy
# 2-core machine costs seconds: its continuations are 32 tokens (12 for the long prompt).
PROMPT_SETS = {"smollm2": (PROMPTS, NUM_GREEDY, NUM_GREEDY), "gemma": (GEMMA_PROMPTS, 32, 12)}


def main():
    default_model = os.path.join(os.environ.get("TESSERA_MODEL_DIR", os.path.expanduser("~/.cache/tessera/models")),
                                 "SmolLM2-135M-Instruct.Q4_1.gguf")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=default_model)
    ap.add_argument("--out", default=str(pathlib.Path(__file__).resolve().parent.parent / "tests/fixtures/reference"))
    ap.add_argument("--name", default="smollm2-135m-instruct-q4_1")
    ap.add_argument("--prompts", choices=sorted(PROMPT_SETS), default="smollm2")
    ap.add_argument("--n-ctx", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2,
                    help="llama.cpp threads (the bits do not depend on it; 1 on a busy machine, where "
                         "ggml's spinning threads stall)")
    ap.add_argument("--last-logits-only", action="store_true",
                    help="logits of the last position only (logits_all off): for large vocabularies")
    ap.add_argument("--no-repack", action="store_true",
                    help="load the weights as the file stores them (llama_model_params.use_extra_bufts "
                         "off): llama.cpp's plain ggml_vec_dot kernels instead of its AVX2 repacked "
                         "Q4_0 / Q4_K / IQ4_NL GEMMs, which round differently")
    ap.add_argument("--no-tiled", action="store_true",
                    help="GGML_CPU_TILED_MM=0: K-quant (Q4_K, Q5_K, Q6_K, ...) matmuls of 8 or more rows "
                         "through ggml_vec_dot as single rows are, not llama.cpp's tiled kernel, whose "
                         "summation order differs (so the fixture does not depend on the batch size)")
    args = ap.parse_args()
    if args.no_tiled:
        # Read once by libggml-cpu at its first tiled-eligible matmul: set before the model loads.
        os.environ["GGML_CPU_TILED_MM"] = "0"

    import llama_cpp
    from llama_cpp import Llama

    if args.no_repack:
        # Llama() takes no use_extra_bufts argument; it starts from the library's defaults,
        # looked up in the llama_cpp.llama_cpp bindings module.
        import llama_cpp.llama_cpp as bindings
        library_defaults = bindings.llama_model_default_params

        def defaults_without_repack():
            params = library_defaults()
            params.use_extra_bufts = False
            return params

        bindings.llama_model_default_params = defaults_without_repack

    # logits_all keeps n_ctx x vocab floats and computes the output layer for every position;
    # with Gemma's 262k vocabulary that is most of the time, so only the last position's
    # logits are asked for (--last-logits-only): the rows before it are computed alike.
    llm = Llama(model_path=args.model, n_ctx=args.n_ctx, n_threads=args.threads, logits_all=not args.last_logits_only,
                verbose=False, flash_attn=False, type_k=0, type_v=0)

    def last_logits():
        if not args.last_logits_only:
            return np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
        row = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
        return np.ctypeslib.as_array(row, shape=(llm.n_vocab(),)).astype(np.float32)

    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    logits_path = out_dir / f"{args.name}.logits.f32"
    records = []
    with open(logits_path, "wb") as logits_file:
        prompts, num_greedy, num_greedy_long = PROMPT_SETS[args.prompts]
        for name, text, parse_special in prompts:
            ids = llm.tokenize(text.encode("utf-8"), add_bos=True, special=parse_special)
            llm.reset()
            llm.eval(ids)
            last = last_logits()
            logits_file.write(last.astype("<f4").tobytes())
            # Each next token comes from evaluating the whole sequence as one batch: llama.cpp's
            # one-token decode path takes other kernels (tinyBLAS for Q.K) and rounds
            # differently from its own batch evaluation (measured: up to 0.35 in a logit), while
            # the batch numerics are the same for every position, as Tessera's are.
            greedy = []
            for _ in range(num_greedy if name != "long-window" else num_greedy_long):
                token = int(last_logits().argmax())
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
        "settings": {"n_ctx": args.n_ctx, "kv_cache": "f32", "flash_attn": False, "n_threads": args.threads,
                     "logits_all": not args.last_logits_only, "repacked_weights": not args.no_repack,
                     "tiled_kquant_matmul": not args.no_tiled},
        "vocab_size": llm.n_vocab(),
        "logits_file": logits_path.name,
        "num_greedy_tokens": PROMPT_SETS[args.prompts][1],
        "prompts": records,
    }
    (out_dir / f"{args.name}.json").write_text(json.dumps(meta, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {out_dir / (args.name + '.json')} and {logits_path}", file=sys.stderr)


if __name__ == "__main__":
    main()
