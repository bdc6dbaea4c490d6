"""`tessera tokenizer export` (issue 16 part 5): the Hugging Face tokenizer.json it writes,
loaded by the `tokenizers` package, gives Tessera's token ids (`tessera tokenize
--add-special --parse-special`, what /v1/completions feeds the model) on a varied text set:
unicode, whitespace runs, digits, code, special tokens; and llama.cpp's own tokenizer test
inputs (shared/testdata/tokenizer/*.inp). For the real SmolLM2 vocabulary and the gpt2 test
vocabulary; the SentencePiece test vocabulary is refused with a clear error.
"""
import json
import os
import subprocess
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(__file__))
import server_harness as h  # noqa: E402

h.require_environment(modules=("tokenizers",))
from tokenizers import Tokenizer  # noqa: E402

MODEL = os.path.join(os.environ.get("TESSERA_MODEL_DIR", os.path.expanduser("~/.cache/tessera/models")),
                     "SmolLM2-135M-Instruct.Q4_1.gguf")
TESTDATA = os.path.join(os.environ.get("TESSERA_SHARED_DIR", os.path.join(h.SOURCE_DIR, "..", "shared")),
                        "testdata", "tokenizer")

TEXTS = [
    "Hello world",
    " Hello world",
    "Hello, World! How's it going? I'm fine; they'll see, we've been, you'd know.",
    "   leading spaces and trailing   ",
    "tabs\tand\t\ttabs\nnew\n\nlines\r\nwindows\u00a0nbsp",
    "          ten spaces then text",
    "1234567890 3.14159 1,000,000 2026-12-01 0x1F 1e-5",
    "Les élèves étudient à l'université de Genève. Ça va très bien, merci !",
    "Москва — столица России. Ελληνικά κείμενα. עברית וערבית: العربية",
    "東京は日本の首都です。中文分词测试。한국어 텍스트입니다.",
    "emoji 🗼🚀👩‍👩‍👧‍👦 flags 🇫🇷🇯🇵 and ✓ ✗ → ∑ ∫ ≤ ≥",
    "def fibonacci(n):\n    \"\"\"Return the n-th number.\"\"\"\n    if n < 2:\n        return n\n"
    "    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "#include <vector>\nint sum(const std::vector<int>& v) { int s = 0; for (int x : v) s += x; return s; }",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text <|im_end|>",
    "a<|im_start|>b<|im_start|><|im_end|>c",
    "{\"key\": [1, 2, 3], \"nested\": {\"a\": null, \"b\": true}}",
    "https://example.com/path?query=1&x=y#frag  user@example.org",
    "!!!???...,,,;;;:::---___===+++***&&&%%%$$$###@@@",
    "don't DON'T Don't 's 't 're 've 'm 'll 'd",
    "\n\n\n\n",
    " ",
    "A",
    "ÀÁÂÃÄÅ àáâãäå ǅ ǈ ß ẞ ﬁ ﬂ",
    "\u200b zero width \u200d joiner \ufeff bom",
]


def llama_cpp_inputs(vocab):
    path = os.path.join(TESTDATA, vocab + ".inp")
    if not os.path.exists(path):
        return []
    text = open(path, encoding="utf-8").read()
    return [t for t in text.split("\n__ggml_vocab_test__\n") if t]


def export(model, out_dir):
    return subprocess.run([h.TESSERA, "tokenizer", "export", model, os.path.join(out_dir, "tokenizer.json")],
                          capture_output=True, text=True, timeout=h.request_timeout(300))


def tessera_ids(model, text):
    out = subprocess.run([h.TESSERA, "tokenize", "-m", model, "--add-special", "--parse-special", "--text", text],
                         capture_output=True, text=True, timeout=h.request_timeout(60))
    assert out.returncode == 0, out.stderr
    return [int(x) for x in out.stdout.split()]


class TokenizerExport(unittest.TestCase):
    def check_vocab(self, model, texts):
        with tempfile.TemporaryDirectory() as d:
            r = export(model, d)
            self.assertEqual(r.returncode, 0, r.stderr)
            tok = Tokenizer.from_file(os.path.join(d, "tokenizer.json"))
            config = json.load(open(os.path.join(d, "tokenizer_config.json")))
        mismatches = []
        for text in texts:
            want = tessera_ids(model, text)
            got = tok.encode(text, add_special_tokens=True).ids
            if got != want:
                mismatches.append((text, got, want))
        for text, got, want in mismatches[:5]:
            print(f"MISMATCH {text!r}:\n  hf      {got}\n  tessera {want}")
        self.assertEqual(len(mismatches), 0, f"{len(mismatches)} of {len(texts)} texts differ")
        print(f"\n{os.path.basename(model)}: {len(texts)} texts, ids identical")
        return tok, config

    def test_smollm2(self):
        tok, config = self.check_vocab(MODEL, TEXTS)
        # Special tokens are added tokens, decoding gives the text back, the config carries
        # the chat template and the end token.
        self.assertEqual(tok.token_to_id("<|im_start|>"), tessera_ids(MODEL, "<|im_start|>")[0])
        ids = tok.encode(TEXTS[7]).ids
        self.assertEqual(tok.decode(ids), TEXTS[7])
        self.assertIn("chat_template", config)
        self.assertEqual(config["eos_token"], "<|im_end|>")

    def test_gpt2_test_vocabulary(self):
        model = os.path.join(TESTDATA, "ggml-vocab-gpt-2.gguf")
        if not os.path.exists(model):
            self.skipTest(f"{model} is missing")
        self.check_vocab(model, TEXTS + llama_cpp_inputs("ggml-vocab-gpt-2.gguf"))

    def test_smollm2_on_llama_cpp_inputs(self):
        inputs = llama_cpp_inputs("ggml-vocab-gpt-2.gguf")
        if not inputs:
            self.skipTest("llama.cpp's tokenizer inputs are missing")
        self.check_vocab(MODEL, inputs)

    def test_sentencepiece_is_refused_with_a_message(self):
        model = os.path.join(TESTDATA, "ggml-vocab-llama-spm.gguf")
        if not os.path.exists(model):
            self.skipTest(f"{model} is missing")
        with tempfile.TemporaryDirectory() as d:
            r = export(model, d)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("only byte-level BPE", r.stderr)


if __name__ == "__main__":
    sys.exit(h.run_tests([TokenizerExport]))
