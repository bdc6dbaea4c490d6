#!/usr/bin/env python3
"""Writes the seed corpora of the fuzz targets into tests/fuzz/corpus/<target>/seed-*.

Seeds are small valid (and a few nearly valid) inputs that reach deep into each parser; the
fuzzer mutates them. Inputs that once crashed are kept beside them as regression-* files
(scripts/fuzz.sh copies new crashes there). Re-running this script rewrites only seed-* files.
"""
import pathlib
import struct

ROOT = pathlib.Path(__file__).resolve().parent / "corpus"
REPO = pathlib.Path(__file__).resolve().parents[2]


def gguf_string(s: bytes) -> bytes:
    return struct.pack("<Q", len(s)) + s


def gguf(kvs, tensors, alignment=32, version=3) -> bytes:
    """kvs: [(key, type_id, packed_value)], tensors: [(name, dims, ggml_type, data)]."""
    out = b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(kvs))
    for key, type_id, value in kvs:
        out += gguf_string(key.encode()) + struct.pack("<I", type_id) + value
    offset = 0
    infos, blobs = b"", b""
    for name, dims, ggml_type, data in tensors:
        infos += gguf_string(name.encode()) + struct.pack("<I", len(dims))
        infos += b"".join(struct.pack("<q", d) for d in dims)
        infos += struct.pack("<IQ", ggml_type, offset)
        padded = data + b"\0" * ((-len(data)) % alignment)
        blobs += padded
        offset += len(padded)
    out += infos
    out += b"\0" * ((-len(out)) % alignment)
    return out + blobs


def s_array(items):
    return struct.pack("<IQ", 8, len(items)) + b"".join(gguf_string(i.encode()) for i in items)


def i32_array(items):
    return struct.pack("<IQ", 5, len(items)) + b"".join(struct.pack("<i", i) for i in items)


def write(target, name, data: bytes):
    d = ROOT / target
    d.mkdir(parents=True, exist_ok=True)
    (d / f"seed-{name}").write_bytes(data)


def gguf_seeds():
    f32 = struct.pack("<8f", *range(8))
    q8 = (struct.pack("<e", 0.5) + bytes(range(32))) * 2  # two Q8_0 blocks
    write("gguf", "tensors", gguf(
        [("general.architecture", 8, gguf_string(b"llama")),
         ("llama.block_count", 4, struct.pack("<I", 1)),
         ("general.alignment", 4, struct.pack("<I", 32)),
         ("x.f64", 12, struct.pack("<d", 1.5)), ("x.bool", 7, b"\x01"),
         ("x.i64", 11, struct.pack("<q", -3))],
        [("w", [8], 0, f32), ("q", [32, 2], 8, q8)]))
    tokens = ["<unk>", "<s>", "</s>", "a", "b", "ab", "▁a"]
    write("gguf", "spm-vocab", gguf(
        [("tokenizer.ggml.model", 8, gguf_string(b"llama")),
         ("tokenizer.ggml.tokens", 9, s_array(tokens)),
         ("tokenizer.ggml.scores", 9, struct.pack("<IQ", 6, len(tokens)) +
          b"".join(struct.pack("<f", -i) for i in range(len(tokens)))),
         ("tokenizer.ggml.token_type", 9, i32_array([2, 3, 3, 1, 1, 1, 1])),
         ("tokenizer.ggml.bos_token_id", 4, struct.pack("<I", 1))], []))
    write("gguf", "bpe-vocab", gguf(
        [("tokenizer.ggml.model", 8, gguf_string(b"gpt2")),
         ("tokenizer.ggml.pre", 8, gguf_string(b"smollm")),
         ("tokenizer.ggml.tokens", 9, s_array(["a", "b", "ab", "<|im_start|>"])),
         ("tokenizer.ggml.merges", 9, s_array(["a b"])),
         ("tokenizer.ggml.token_type", 9, i32_array([1, 1, 1, 3]))], []))
    write("gguf", "v2-header", gguf([("k", 4, struct.pack("<I", 7))], [], version=2))
    write("gguf", "empty-tables", gguf([], []))


def config_seeds():
    for path in sorted((REPO / "configs").rglob("*.yaml")):
        write("config", path.name, path.read_bytes())
    write("config", "extends", b"extends: base.yaml\nengine:\n  kv_cache: {plugin: paged, memory: 64MiB}\n")
    write("config", "anchors", b"a: &x {plugin: static}\nengine: {scheduler: *x}\nmodel: {path: m}\n")
    write("config", "server", b"model: {path: m}\nserver: {host: 127.0.0.1, port: 0, api_keys: [k]}\n")
    write("config", "deployments", b"deployments:\n  a: {model: {path: m}}\n  b: {extends: base.yaml, engine: "
          b"{scheduler: {plugin: continuous}}}\ngateway: {cache: [{plugin: exact, ttl: 1m}], "
          b"router: {plugin: ab-split, name: ab, arms: {a: 1, b: 3}}}\n")


def tokenizer_seeds():
    texts = [b"Hello world! 123 4567", "caf\u00e9 \u4f60\u597d \U0001f600".encode(),
             b"<|im_start|>user\nhi<|im_end|>", b"  \t\n\r spaces   and\ttabs",
             b"def f(x):\n    return x**2  # ok", b"\xff\xfe invalid \xc3", b"ab<tool>ab"]
    n = 0
    for selector in range(0, 13, 3):
        for flags in (0, 3, 7):
            write("tokenizer", f"{n:02d}", bytes([selector, flags]) + texts[n % len(texts)])
            n += 1


def chat_template_seeds():
    smol = (b"{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
            b"{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
            b"Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
            b"message['content'] + '<|im_end|>' + '\n'}}{% endfor %}")
    msgs = b"\0system\0Be brief.\0user\0Hi!\0assistant\0Hello.\0user\0Bye"
    write("chat_template", "smollm2", smol + msgs)
    write("chat_template", "llama3", b"<|start_header_id|>" + msgs)
    write("chat_template", "gemma", b"<start_of_turn>" + msgs)
    write("chat_template", "empty", b"")


if __name__ == "__main__":
    gguf_seeds()
    config_seeds()
    tokenizer_seeds()
    chat_template_seeds()
