#!/usr/bin/env python3
"""Writes llama.cpp's prompt log-probabilities for the lm-eval multiple-choice task's requests:
every position's log-probability of the next token, as `echo` + `logprobs` returns them and
lm-eval sums them into loglikelihoods. The suite compares Tessera's exact stack with it
(tests/integration/test_server_prompt_logprobs.py). The output is committed, so CI needs no
llama.cpp.

Each request is what lm-eval sends for tests/lm_eval/tessera_mc.jsonl: the task's context
"Question: <question>\\nAnswer:" followed by " <choice>", for every choice; plus one longer
text of a few hundred tokens, so positions far into a sequence are covered too.

    pip install llama-cpp-python numpy
    scripts/make-prompt-logprob-fixture.py [--model FILE.gguf] [--out tests/fixtures/reference]

Settings as scripts/make-reference-fixtures.py's (recorded in the JSON): KV cache f32, flash
attention off, n_ctx 2048, the sequence evaluated as one batch with logits for every position.
The llama.cpp build must use AVX2 kernels, not AVX-512 ones, as the committed fixtures do
(Tessera's exact stack follows ggml's AVX2 summation order; an AVX-512 build's F32 matmuls sum
in 16 lanes and differ by up to 0.5 in a logprob past the first few positions). On an AVX-512
machine, build the vendored llama.cpp of the llama-cpp-python sdist with
  -DBUILD_SHARED_LIBS=ON -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
  -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX_VNNI=OFF (and AMX off)
and run this with LLAMA_CPP_LIB_PATH=<that build>/bin. The ISA line llama.cpp reports is
recorded in the JSON.
"""
import argparse
import json
import math
import os
import pathlib
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
LONG_TEXT = ("The printing press reached Europe in the fifteenth century. " + "".join(
    f"In year {1450 + 10 * i} a workshop in town {i} printed {3 * i + 2} books, each of {40 + i} pages, "
    f"and sold {i + 1} of them to the local school. " for i in range(12)))


def requests():
    out = []
    with open(ROOT / "tests/lm_eval/tessera_mc.jsonl") as f:
        for line in f:
            doc = json.loads(line)
            context = f"Question: {doc['question']}\nAnswer:"
            for choice in doc["choices"]:
                out.append({"name": f"{doc['question'][:24]}/{choice}", "text": context + " " + choice})
    out.append({"name": "long", "text": LONG_TEXT})
    return out


def main():
    default_model = os.path.join(os.environ.get("TESSERA_MODEL_DIR", os.path.expanduser("~/.cache/tessera/models")),
                                 "SmolLM2-135M-Instruct.Q4_1.gguf")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=default_model)
    ap.add_argument("--out", default=str(ROOT / "tests/fixtures/reference"))
    ap.add_argument("--name", default="smollm2-135m-instruct-q4_1.prompt-logprobs")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import llama_cpp
    from llama_cpp import Llama

    llm = Llama(model_path=args.model, n_ctx=2048, n_threads=args.threads, logits_all=True, verbose=False,
                flash_attn=False, type_k=0, type_v=0)
    records = []
    for r in requests():
        ids = llm.tokenize(r["text"].encode("utf-8"), add_bos=True, special=False)
        llm.reset()
        llm.eval(ids)
        logprobs = []
        for i in range(len(ids) - 1):
            row = np.array(llm.scores[i], dtype=np.float64)
            top = row.max()
            logprobs.append(float(row[ids[i + 1]] - top - math.log(np.exp(row - top).sum())))
        records.append(dict(r, tokens=ids, token_logprobs=logprobs))
        print(f"{r['name']}: {len(ids)} tokens, loglikelihood {sum(logprobs):.4f}", file=sys.stderr)
    meta = {
        "model_file": os.path.basename(args.model),
        "reference": f"llama-cpp-python {llama_cpp.__version__}",
        "settings": {"n_ctx": 2048, "kv_cache": "f32", "flash_attn": False, "n_threads": args.threads,
                     "logits_all": True, "system_info": llama_cpp.llama_print_system_info().decode().strip()},
        "what": "token_logprobs[i] is log p(tokens[i + 1] | tokens[0..i])",
        "requests": records,
    }
    path = pathlib.Path(args.out) / f"{args.name}.json"
    path.write_text(json.dumps(meta, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
