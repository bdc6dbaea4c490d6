#!/usr/bin/env python3
"""What each `tessera quantize` method x type costs on the default model, measured by `tessera eval`.

The reference is the model's F32 dequantization (we have no higher-precision copy of
SmolLM2-135M-Instruct): `tessera quantize --type F32`, evaluated once with the bit-exact stack
(configs/smollm2-cpu-f32kv.yaml) and its log-probabilities saved. Every quantized file is then
made from that F32 file and evaluated against the saved reference on the same text, with the
same stack: perplexity, KLD mean / 99 %, top-1 agreement, and file size.

  bench/quantize_eval.py --out /tmp/q --chunks 14 [--peer ~/.cache/tessera/peer/.../build/bin]

Corpora (both shipped by Debian's base-files): evaluation /usr/share/common-licenses/GPL-3,
calibration /usr/share/common-licenses/GFDL-1.3. With --peer, llama.cpp's llama-quantize (plain,
and with a llama-imatrix matrix from the same calibration text) adds rows, evaluated the same way,
and llama-perplexity reports its own perplexity of Tessera's files. Prints a Markdown table.

Methods: rtn, importance (from a saved imatrix), gptq and awq (each calibrating itself on
--calibration; both need the full input covariances, which an imatrix file does not hold).
W8A8 rows (--w8a8): quantizer.int8 loading the F32 file (int8 weights per output row, int8
activations per token), and the same on an AWQ-folded F32 file (`--type F32 --method awq
--awq-alpha 0.5`: activation outliers moved into the weights, SmoothQuant's idea).

Speed (unless --no-speed): `tessera bench latency -p 512 -g 128` of every row's file on the
default serving stack (configs/smollm2-cpu.yaml, quantizer.gguf interleaved; the W8A8 rows with
quantizer.int8), and the weight bytes one token reads as that stack holds them.
Types in --pure-types are made with --pure by both quantizers (Q4_K: llama-quantize --pure
Q4_K_S, the same tensor types as Tessera's --pure Q4_K); llama.cpp's Q4_K_M stays as a context row.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = Path(os.environ.get("TESSERA_MODEL_DIR", Path.home() / ".cache/tessera/models")) / \
    "SmolLM2-135M-Instruct.Q4_1.gguf"
PEER_FTYPE = {"Q4_0": "Q4_0", "Q4_1": "Q4_1", "Q5_0": "Q5_0", "Q5_1": "Q5_1", "Q8_0": "Q8_0",
              "Q4_K": "Q4_K_M", "Q6_K": "Q6_K"}
# With --pure every weight gets the named type (or its row-length fallback), as Tessera's --pure.
PEER_PURE_FTYPE = {"Q4_K": "Q4_K_S"}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run(cmd, **kw) -> subprocess.CompletedProcess:
    log("+ " + " ".join(str(c) for c in cmd))
    return subprocess.run([str(c) for c in cmd], check=True, **kw)


def stack(out: Path, name: str, model: Path) -> Path:
    p = out / f"{name}.yaml"
    p.write_text(f"extends: {ROOT / 'configs/smollm2-cpu-f32kv.yaml'}\nmodel: {{path: {model}}}\n")
    return p


def speed_stack(out: Path, name: str, model: Path, quantizer: str = "") -> Path:
    p = out / f"{name}.speed.yaml"
    engine = f"engine:\n  quantizer: {{plugin: {quantizer}}}\n" if quantizer else ""
    p.write_text(f"extends: {ROOT / 'configs/smollm2-cpu.yaml'}\nmodel: {{path: {model}}}\n{engine}")
    return p


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tessera", type=Path, default=ROOT / "build/bin/tessera")
    ap.add_argument("--model", type=Path, default=MODEL)
    ap.add_argument("--corpus", default="/usr/share/common-licenses/GPL-3")
    ap.add_argument("--calibration", default="/usr/share/common-licenses/GFDL-1.3")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=0, help="evaluation chunks (0: all)")
    ap.add_argument("--types", default="Q4_0,Q4_1,Q5_0,Q5_1,Q8_0,Q4_K,Q6_K")
    ap.add_argument("--methods", default="rtn,importance,gptq,awq")
    ap.add_argument("--pure-types", default="Q4_K", help="types made with --pure (both quantizers)")
    ap.add_argument("--calib-chunks", type=int, default=0, help="gptq/awq calibration chunks (0: all)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--peer-types", default="Q4_0,Q4_K", help="types llama-quantize adds rows for")
    ap.add_argument("--peer", type=Path, help="llama.cpp bin dir (llama-quantize, llama-imatrix, llama-perplexity)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--no-speed", action="store_true", help="skip the pp512 / tg128 measurements")
    ap.add_argument("--speed-repeats", type=int, default=3)
    ap.add_argument("--no-w8a8", action="store_true", help="skip the quantizer.int8 (W8A8) rows")
    args = ap.parse_args()
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    t = args.tessera
    chunks = ["--chunks", args.chunks] if args.chunks else []

    f32 = out / "f32.gguf"
    if not f32.exists():
        run([t, "quantize", "-q", args.model, f32, "--type", "F32", "--threads", args.threads])
    ref = out / "f32.logp"
    if not ref.exists():
        run([t, "eval", "-q", "-c", stack(out, "f32", f32), "-f", args.corpus, "--ctx", args.ctx, *chunks,
             "--save-logits", ref, "--json", out / "f32.json"])
    imatrix = out / "tessera.imatrix"
    if "importance" in args.methods and not imatrix.exists():
        # Activations of the input model (the same weights as f32.gguf) over the calibration text.
        run([t, "quantize", "-q", args.model, out / "calib-probe.gguf", "--type", "Q8_0", "--method", "importance",
             "--calibration", args.calibration, "--ctx", args.ctx, "--save-imatrix", imatrix, "--threads", args.threads])

    rows = []

    def speed(name: str, path: Path, quantizer: str = "") -> dict:
        if args.no_speed:
            return {}
        j = out / f"{name}.speed.json"
        if not j.exists():
            run([t, "bench", "latency", "-c", speed_stack(out, name, path, quantizer), "-p", 512, "-g", 128,
                 "-r", args.speed_repeats, "--json", j], stdout=subprocess.DEVNULL)
        r = json.load(open(j))
        return {"pp512": r["pp"]["tokens_per_s"]["p50"], "tg128": r["tg"]["tokens_per_s"]["p50"],
                "weights_mib": r["model"]["weight_bytes_per_token"] / 2**20}

    peer_env = dict(os.environ, LD_LIBRARY_PATH=str(args.peer)) if args.peer else None

    def llama_kld(path: Path) -> dict:
        """llama-perplexity --kl-divergence of `path` against its own base file of f32.gguf."""
        if not args.peer:
            return {}
        cached = out / f"{path.stem}.llama-kld.txt"
        base = out / "llama-f32.kld"
        common = ["-c", args.ctx, "-t", args.threads, *(["--chunks", args.chunks] if args.chunks else [])]
        if not base.exists():
            run([args.peer / "llama-perplexity", "-m", f32, "-f", args.corpus, *common, "--kl-divergence-base", base],
                env=peer_env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if not cached.exists():
            p = run([args.peer / "llama-perplexity", "-m", path, *common, "--kl-divergence-base", base,
                     "--kl-divergence"], env=peer_env, capture_output=True, text=True)
            cached.write_text(p.stdout + p.stderr)
        text = cached.read_text()

        def field(label: str) -> float:
            line = next(l for l in text.splitlines() if l.startswith(label))
            return float(line.split(":", 1)[1].split()[0])
        return {"llama_ppl": field("Mean PPL(Q)"), "llama_kld_mean": field("Mean    KLD"),
                "llama_kld_p99": field("99.0%   KLD"), "llama_top1": field("Same top p") / 100}

    def evaluate(label: str, method: str, typ: str, path: Path, quantizer: str = "", name: str = "") -> None:
        name = name or path.stem
        j = out / f"{name}.json"
        t0 = time.time()
        cfg = stack(out, name, path)
        if quantizer:
            cfg.write_text(cfg.read_text() + f"engine:\n  quantizer: {{plugin: {quantizer}}}\n")
        if not j.exists():  # cached: a rerun only adds what is missing
            run([t, "eval", "-q", "-c", cfg, "-f", args.corpus, "--ctx", args.ctx, *chunks,
                 "--reference-logits", ref, "--json", j])
        r = json.load(open(j))
        rows.append({"who": label, "method": method, "type": typ, "size_mib": path.stat().st_size / 2**20,
                     "ppl": r["ppl"], "ppl_err": r.get("ppl_error"), "kld_mean": r["kld"]["mean"],
                     "kld_p99": r["kld"]["p99"], "top1": r["top1_agreement"], "eval_s": time.time() - t0,
                     **speed(name, path, quantizer), **({} if quantizer else llama_kld(path))})
        log(json.dumps(rows[-1]))

    f32_json = json.load(open(out / "f32.json"))
    rows.append({"who": "tessera", "method": "reference", "type": "F32", "size_mib": f32.stat().st_size / 2**20,
                 "ppl": f32_json["ppl"], "ppl_err": f32_json.get("ppl_error"), "kld_mean": 0.0, "kld_p99": 0.0,
                 "top1": 1.0, "eval_s": 0, **speed("f32", f32)})
    if not args.no_w8a8:
        # W8A8 is a load-time layout (quantizer.int8), not a file type: the F32 file as it is, and
        # with activation outliers folded into the weights first.
        evaluate("tessera", "int8 (W8A8)", "F32 file", f32, quantizer="int8", name="w8a8-f32")
        smoothed = out / "awq-folded-f32.gguf"
        if not smoothed.exists():
            run([t, "quantize", "-q", f32, smoothed, "--type", "F32", "--method", "awq", "--awq-alpha", 0.5,
                 "--calibration", args.calibration, "--ctx", args.ctx, "--threads", args.threads,
                 *(["--chunks", args.calib_chunks] if args.calib_chunks else [])])
        evaluate("tessera", "int8 (W8A8), AWQ-folded α 0.5", "F32 file", smoothed, quantizer="int8",
                 name="w8a8-awq-f32")
    pure_types = set(filter(None, args.pure_types.split(",")))
    for typ in args.types.split(","):
        pure = ["--pure"] if typ in pure_types else []
        label = typ + (" --pure" if pure else "")
        for method in args.methods.split(","):
            if method == "gptq" and typ == "Q6_K":
                continue  # gptq writes the 32-block formats and Q4_K (docs/quantize.md)
            q = out / f"tessera-{method}-{typ}{'-pure' if pure else ''}.gguf"
            extra = []
            if method == "importance":
                extra = ["--method", "importance", "--imatrix", imatrix]
            elif method in ("gptq", "awq"):
                extra = ["--method", method, "--calibration", args.calibration, "--ctx", args.ctx]
                if args.calib_chunks:
                    extra += ["--chunks", args.calib_chunks]
            if not q.exists():
                t0 = time.time()
                run([t, "quantize", "-q", f32, q, "--type", typ, "--threads", args.threads, *pure, *extra])
                log(f"quantize {method} {label}: {time.time() - t0:.1f} s")
            rtn = out / f"tessera-rtn-{typ}{'-pure' if pure else ''}.gguf"
            if method != "rtn" and rtn.exists() and rtn.read_bytes() == q.read_bytes():
                rows.append(dict(next(r for r in rows if r["who"] == "tessera" and r["type"] == label
                                      and r["method"] == "rtn"), method=method + " (= rtn bytes)"))
                continue
            evaluate("tessera", method, label, q)

    if args.peer:
        env = dict(os.environ, LD_LIBRARY_PATH=str(args.peer))
        peer_imatrix = out / "llama.imatrix"
        if not peer_imatrix.exists():
            run([args.peer / "llama-imatrix", "-m", args.model, "-f", args.calibration, "-c", args.ctx,
                 "-o", peer_imatrix, "-t", args.threads], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        variants = []
        for typ in args.peer_types.split(","):
            if typ in pure_types:
                variants.append((PEER_PURE_FTYPE.get(typ, typ), ["--pure"]))
            variants.append((PEER_FTYPE[typ], []))
        for ftype, pure in variants:
            for method, extra in (("rtn", []), ("imatrix", ["--imatrix", peer_imatrix])):
                q = out / f"llama-{method}-{ftype}{'-pure' if pure else ''}.gguf"
                if not q.exists():
                    run([args.peer / "llama-quantize", "--allow-requantize", *pure, *extra, f32, q, ftype, args.threads],
                        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                evaluate("llama-quantize", method, ftype + (" --pure" if pure else ""), q)

    def num(r, key, fmt):
        return format(r[key], fmt) if key in r else "–"
    print("| quantizer | method | type | file MiB | weights MiB | pp512 t/s | tg128 t/s | PPL | KLD mean | KLD 99 % | same top-1 "
          "| llama-perplexity: PPL | KLD mean | KLD 99 % | same top-1 |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        llama = (f"{num(r, 'llama_ppl', '.4f')} | {num(r, 'llama_kld_mean', '.5f')} | {num(r, 'llama_kld_p99', '.4f')} | "
                 + (f"{100 * r['llama_top1']:.2f} %" if "llama_top1" in r else "–"))
        print(f"| {r['who']} | {r['method']} | {r['type']} | {r['size_mib']:.1f} | {num(r, 'weights_mib', '.1f')} | "
              f"{num(r, 'pp512', '.0f')} | {num(r, 'tg128', '.1f')} | {r['ppl']:.4f} | "
              f"{r['kld_mean']:.5f} | {r['kld_p99']:.4f} | {100 * r['top1']:.2f} % | {llama} |")
    json.dump(rows, open(out / "table.json", "w"), indent=1)


if __name__ == "__main__":
    main()
