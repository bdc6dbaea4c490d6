#!/usr/bin/env python3
"""Reference token ids and embeddings of all-MiniLM-L6-v2 from sentence-transformers, for
tests/unit/test_embedding_model.cpp (ctest unit_test_embedding_model).

Needs torch and sentence-transformers, which CI does not install: the output is committed.
Run it in a throwaway virtual environment:

    python3 -m venv /tmp/st-venv
    /tmp/st-venv/bin/pip install torch sentence-transformers
    scripts/fetch-models.sh
    /tmp/st-venv/bin/python scripts/make-embedding-fixtures.py \\
        ~/.cache/tessera/models/all-MiniLM-L6-v2 tests/fixtures/embedding/all-minilm-l6-v2.json
"""
import json
import sys

import sentence_transformers
import torch
from sentence_transformers import SentenceTransformer

LONG = " ".join(["The quick brown fox jumps over the lazy dog while the committee deliberates."] * 30)

SENTENCES = [
    "Hello, world!",
    "How do I reset my password?",
    "What's the best way to reset a forgotten password?",
    "The café served crème brûlée and a piña colada.",
    "Ångström, naïve, façade, résumé, Zürich, São Paulo",
    "ÉCOLE NORMALE SUPÉRIEURE — İstanbul, Straße, ΣΊΣΥΦΟΣ",
    "東京は日本の首都です。北京是中国的首都。",
    "서울은 한국의 수도입니다.",
    "Emoji are tokens too 😀🚀🎉, aren't they?",
    "Prices: $3.50, €4,20, ¥1000 — 50% off!!! (limited) [offer] {now}",
    "e-mail: someone@example.com; url: https://example.com/a?b=c&d=e#frag",
    "Tabs\tand\nnewlines\r\nand  multiple   spaces",
    "unaffable antidisestablishmentarianism supercalifragilisticexpialidocious",
    "Numbers like 3.14159, 2,718 and 1e-9 are split.",
    "A sentence with a [MASK] token and [SEP] inside it.",
    "Ünïcödé dïäcrïtïcs everywhere: àáâãäå ñ ç ø œ æ ß",
    "Привет, как дела? Всё хорошо.",
    "مرحبا بالعالم",
    "Zero\u200bwidth space and soft\u00adhyphen and control\u0007char",
    "x" * 120,
    LONG,
    "",
]


def main():
    model_dir, out_path = sys.argv[1], sys.argv[2]
    model = SentenceTransformer(model_dir, device="cpu")
    tok = model.tokenizer
    cases = []
    embeddings = model.encode(SENTENCES, batch_size=8, convert_to_numpy=True, normalize_embeddings=False)
    for text, emb in zip(SENTENCES, embeddings):
        ids = tok(text, truncation=True, max_length=model.max_seq_length)["input_ids"]
        cases.append({"text": text, "ids": ids, "embedding": [float(f"{x:.8g}") for x in emb.tolist()]})
    out = {
        "generator": "scripts/make-embedding-fixtures.py",
        "sentence_transformers": sentence_transformers.__version__,
        "torch": torch.__version__,
        "max_seq_length": model.max_seq_length,
        "cases": cases,
    }
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"{out_path}: {len(cases)} cases")


if __name__ == "__main__":
    main()
