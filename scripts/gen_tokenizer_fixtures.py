#!/usr/bin/env python3
"""Prints C++ fixtures of reference token ids from llama.cpp (through llama-cpp-python) for
tests/unit/test_tokenizer.cpp ("SmolLM2 vocabulary matches llama.cpp").

Usage: python3 scripts/gen_tokenizer_fixtures.py MODEL.gguf
Paste the output between the SMOLLM_FIXTURES_BEGIN / _END markers.
"""
import sys
import unicodedata

import llama_cpp

TEXTS = [
    "Hello world",
    " Hello, world! It's a test: don't, we'll, I'm, you've, they're, she'd. IT'S DON'T",
    "Numbers: 3.14159, 1234567890, 2024-01-01, 1/2 = 0.5, ½ ² ٣ ①",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n-1) + fibonacci(n-2)\n",
    "int main() { std::vector<int> v{1, 2, 3}; return v[0] != 0 ? -1 : 0; } // C++",
    "Whitespace   runs\t\ttabs\n\n\nnewlines   \n  trailing   ",
    "Unicode: naïve café, Führer, Ελληνικά, русский, 日本語のテキスト, 한국어, नमस्ते",
    "Emoji 🦙🚀😶‍🌫️✅👍🏽 and symbols ∑∫√∞ ©®™ €£¥",
    "<|im_start|>user\nnot special without parse_special<|im_end|>",
    "CAPS'S and 'quotes' \"double\" `back` ''' ...",
    "\u00a0non-breaking\u3000ideographic\u2003em space",
    "    ",
    "\n",
]


def cpp_string(text: str) -> str:
    """A C++ literal: printable characters as UTF-8, invisible or combining ones (NBSP, ZWJ,
    variation selectors, viramas, ...) as hex escapes so the fixture shows what is there."""
    out = []
    for ch in text:
        if ch == "\\":
            out.append("\\\\")
        elif ch == '"':
            out.append('\\"')
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ch == " " or (ch.isprintable() and unicodedata.category(ch)[0] not in "ZCM"):
            out.append(ch)
        else:
            # Close the literal after the escape so following hex digits are not absorbed.
            out.append("".join("\\x%02X" % b for b in ch.encode("utf-8")) + '" "')
    return '"' + "".join(out) + '"'


def main() -> None:
    llm = llama_cpp.Llama(model_path=sys.argv[1], vocab_only=True, verbose=False)
    print("  const std::vector<Case> cases = {")
    for text in TEXTS:
        ids = llm.tokenize(text.encode("utf-8"), add_bos=False, special=False)
        print(f"      {{{cpp_string(text)},")
        print(f"       {{{', '.join(str(i) for i in ids)}}}}},")
    print("  };")


if __name__ == "__main__":
    main()
