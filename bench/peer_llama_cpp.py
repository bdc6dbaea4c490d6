#!/usr/bin/env python3
"""Tessera beside llama.cpp, measured in one run on the same GGUF and the same workload.

The peer is llama.cpp as vendored by the `llama-cpp-python` source package on PyPI (the
only registry this project may reach), built once into ~/.cache/tessera/peer with
GGML_NATIVE, so it uses every instruction set of this CPU as Tessera does. It is for
benchmarks only; CI never builds it.

  bench/peer_llama_cpp.py build                 # fetch and build llama-bench + llama-server
  bench/peer_llama_cpp.py latency -r 3          # pp512 / tg128, interleaved peer, tessera, ...
  bench/peer_llama_cpp.py serve --clients 16    # llama-server -np 16 -cb vs tessera serve, alternating rounds
  bench/peer_llama_cpp.py all --write-docs      # both, table into docs/benchmarks.md
  bench/peer_llama_cpp.py formats -r 3 --write-docs   # pp512 / tg128 per weight format

Every figure in the table comes from this script's own run; ratios are Tessera / llama.cpp.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PEER_VERSION = "0.3.36"  # the llama-cpp-python release whose fixtures tests/ compares with
CACHE = Path(os.environ.get("TESSERA_PEER_DIR", Path.home() / ".cache/tessera/peer"))
DEFAULT_MODEL = Path(os.environ.get("TESSERA_MODEL_DIR", Path.home() / ".cache/tessera/models")) / \
    "SmolLM2-135M-Instruct.Q4_1.gguf"
DOCS_BEGIN = "<!-- peer-llama-cpp:begin -->"
DOCS_END = "<!-- peer-llama-cpp:end -->"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    log("+ " + " ".join(str(c) for c in cmd))
    return subprocess.run([str(c) for c in cmd], check=True, **kw)


# ----------------------------------------------------------------------------- build


def peer_dir() -> Path:
    return CACHE / f"llama-cpp-python-{PEER_VERSION}"


def peer_bin(name: str) -> Path:
    return peer_dir() / "build" / "bin" / name


def build_peer(jobs: int, targets: list[str]) -> None:
    if all(peer_bin(t).exists() for t in targets):
        log(f"peer already built in {peer_dir()}")
        return
    src = peer_dir() / "src"
    if not (src / "vendor" / "llama.cpp" / "CMakeLists.txt").exists():
        with tempfile.TemporaryDirectory() as tmp:
            run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                 f"llama-cpp-python=={PEER_VERSION}", "-d", tmp])
            archive = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
            with tarfile.open(archive) as tar:
                tar.extractall(tmp, filter="data")
            shutil.rmtree(src, ignore_errors=True)
            src.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(next(p for p in Path(tmp).iterdir() if p.is_dir())), src)
    build = peer_dir() / "build"
    run(["cmake", "-S", src / "vendor" / "llama.cpp", "-B", build, "-G", "Ninja",
         "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF",
         "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TOOLS=ON",
         "-DLLAMA_BUILD_SERVER=ON", f"-DCMAKE_RUNTIME_OUTPUT_DIRECTORY={build / 'bin'}"])
    run(["cmake", "--build", build, "-j", str(jobs), "--target", *targets])


# ----------------------------------------------------------------------------- latency


def llama_bench_once(model: Path, threads: int, pp: int, tg: int) -> dict[str, float]:
    out = run([peer_bin("llama-bench"), "-m", model, "-t", threads, "-p", pp, "-n", tg, "-r", 1,
               "-o", "json"], capture_output=True, text=True).stdout
    rows = json.loads(out)
    result = {}
    for r in rows:
        if r.get("n_prompt", 0) > 0 and r.get("n_gen", 0) == 0:
            result["pp"] = float(r["avg_ts"])
        elif r.get("n_gen", 0) > 0 and r.get("n_prompt", 0) == 0:
            result["tg"] = float(r["avg_ts"])
    return result


def tessera_bench_once(tessera: Path, config: Path, pp: int, tg: int) -> dict[str, object]:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        run([tessera, "bench", "latency", "-c", config, "-p", pp, "-g", tg, "-r", 1, "--json", f.name],
            stdout=subprocess.DEVNULL)
        j = json.load(open(f.name))
    return {"pp": j["pp"]["tokens_per_s"]["p50"], "tg": j["tg"]["tokens_per_s"]["p50"],
            "pp_roofline": j["pp"]["roofline_tokens_per_s"], "tg_roofline": j["tg"]["roofline_tokens_per_s"],
            "machine": j["machine"]}


def measure_latency(args) -> dict:
    rounds = {"llama.cpp": {"pp": [], "tg": []}, "tessera": {"pp": [], "tg": []}}
    last = None
    for r in range(args.repeats):
        log(f"latency round {r + 1}/{args.repeats}")
        peer = llama_bench_once(args.model, args.threads, args.pp, args.tg)
        last = tessera_bench_once(args.tessera, args.config, args.pp, args.tg)
        for k in ("pp", "tg"):
            rounds["llama.cpp"][k].append(peer[k])
            rounds["tessera"][k].append(float(last[k]))
    return {"rounds": rounds, "pp_roofline": last["pp_roofline"], "tg_roofline": last["tg_roofline"],
            "machine": last["machine"], "pp": args.pp, "tg": args.tg}


# ----------------------------------------------------------------------------- format sweep

FORMATS = ["Q4_1", "Q4_0", "Q8_0", "Q4_K_M", "Q6_K", "Q5_0"]


def format_model(args, fmt: str) -> Path:
    """The default model requantized to `fmt` with the peer's llama-quantize (cached); Q4_1 is
    the shipped file itself."""
    if fmt == "Q4_1" and args.model == DEFAULT_MODEL:
        return args.model
    out = args.format_dir / f"{args.model.stem.rsplit('.', 1)[0]}.{fmt}.gguf"
    if not out.exists():
        args.format_dir.mkdir(parents=True, exist_ok=True)
        run([peer_bin("llama-quantize"), "--allow-requantize", args.model, out, fmt],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return out


def format_config(args, model: Path, tmp: Path) -> Path:
    """The latency stack (--config) with its model swapped for `model`."""
    path = tmp / f"{model.stem}.yaml"
    path.write_text(f"extends: {args.config.resolve()}\nmodel: {{path: {model}}}\n")
    return path


def loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def measure_formats(args) -> dict:
    """Per format, --repeats rounds of llama-bench then `tessera bench latency`, back to back
    (the ratio of neighbouring runs is what survives this machine's drift); the load average
    is recorded at the start of every round."""
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for fmt in args.formats:
            model = format_model(args, fmt)
            config = format_config(args, model, Path(tmp))
            rounds = {"llama.cpp": {"pp": [], "tg": []}, "tessera": {"pp": [], "tg": []}, "load": []}
            last = None
            for r in range(args.repeats):
                rounds["load"].append(loadavg())
                log(f"{fmt} round {r + 1}/{args.repeats} (load {rounds['load'][-1]})")
                peer = llama_bench_once(model, args.threads, args.pp, args.tg)
                last = tessera_bench_once(args.tessera, config, args.pp, args.tg)
                for k in ("pp", "tg"):
                    rounds["llama.cpp"][k].append(peer[k])
                    rounds["tessera"][k].append(float(last[k]))
            results[fmt] = {"model": str(model), "rounds": rounds, "machine": last["machine"],
                            "pp_roofline": last["pp_roofline"], "tg_roofline": last["tg_roofline"]}
    return results


def formats_table(res: dict, args) -> str:
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    lines = [f"Measured {stamp} by `bench/peer_llama_cpp.py {' '.join(sys.argv[1:])}` "
             f"(llama-bench from llama-cpp-python {PEER_VERSION}, GGML_NATIVE, vs `tessera bench "
             f"latency` on `{display_path(args.config)}` with the model swapped; "
             f"{args.model.name} requantized with the peer's `llama-quantize --allow-requantize`; "
             f"{args.threads} threads; {args.repeats} rounds per format, each llama.cpp then "
             f"Tessera; ratios are of the medians).", ""]
    lines.append(f"| format | pp{args.pp} llama.cpp t/s | pp{args.pp} Tessera t/s | pp ratio | "
                 f"tg{args.tg} llama.cpp t/s | tg{args.tg} Tessera t/s | tg ratio | "
                 "Tessera % of roofline (pp / tg) | load average per round |")
    lines.append("|---|---|---|---|---|---|---|---|---|")
    for fmt, r in res.items():
        rr = r["rounds"]
        cells = [fmt]
        ratios = []
        for k in ("pp", "tg"):
            p, t = rr["llama.cpp"][k], rr["tessera"][k]
            ratios.append(median(t) / median(p))
            cells += [f"{median(p):.1f} ({spread(p)})", f"{median(t):.1f} ({spread(t)})",
                      f"**{ratios[-1]:.2f}×**"]
        cells.append(f"{100 * median(rr['tessera']['pp']) / r['pp_roofline']:.0f}% / "
                     f"{100 * median(rr['tessera']['tg']) / r['tg_roofline']:.0f}%")
        cells.append("; ".join(rr["load"]))
        lines.append("| " + " | ".join(cells) + " |")
    m = next(iter(res.values()))["machine"]
    lines += ["", f"Machine limits measured by `tessera bench latency` in the last round: DRAM read "
              f"{m['read_bandwidth_gb_s']:.1f} GB/s, FP32 FMA peak {m['fma_peak_gflop_s']:.0f} GFLOP/s."]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- serving


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except Exception:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not healthy after {timeout} s")


def write_serving_workload(path: Path, n: int, out_tokens: int) -> None:
    """~128-token prompts (different openings, so no two share more than a few tokens)."""
    subjects = ["a lighthouse keeper", "the history of bread", "a chess opening", "how rivers form",
                "a small robot", "the moons of Jupiter", "a mountain village", "the first computers",
                "an old violin", "desert plants", "a train journey", "the deep ocean", "a city garden",
                "paper making", "a clockmaker", "winter birds"]
    body = ("Write a detailed story about {s}. Describe the place, the people, the sounds and the "
            "colours, what happens in the morning and in the evening, and why it matters to the "
            "people who live there. Use plain words, short sentences and concrete details, and end "
            "with a question for the reader about {s} and what they would have done in that place.")
    with open(path, "w") as f:
        for i in range(n):
            s = subjects[i % len(subjects)]
            prompt = f"Request {i}. " + body.format(s=s) + " " + body.format(s=subjects[(i * 7 + 3) % len(subjects)])
            f.write(json.dumps({"prompt": prompt, "max_tokens": out_tokens}) + "\n")


def served_model_id(url: str) -> str:
    """The first id of GET /v1/models: OpenAI servers may require `model` in each request."""
    with urllib.request.urlopen(url + "/v1/models", timeout=10) as r:
        return json.load(r)["data"][0]["id"]


def bench_serve(tessera: Path, url: str, workload: Path, clients: int, n: int) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        run([tessera, "bench", "serve", "--url", url, "--model", served_model_id(url), "-w", workload,
             "--concurrency", clients, "-n", n, "--json", f.name], stdout=subprocess.DEVNULL)
        j = json.load(open(f.name))
    return j["levels"][0]["metrics"]


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def measure_serving(args) -> dict:
    """`--serve-rounds` rounds of llama.cpp then Tessera, each a fresh server on the same
    workload; this machine's speed drifts by tens of percent within minutes, so the ratio is
    taken per round (neighbouring runs) and its median reported with every round's."""
    rounds: dict[str, list[dict]] = {"llama.cpp": [], "tessera": []}
    with tempfile.TemporaryDirectory() as tmp:
        workload = Path(tmp) / "serve.jsonl"
        write_serving_workload(workload, args.requests, args.out_tokens)
        ctx_per_slot = 512
        servers = {
            "llama.cpp": lambda port: [peer_bin("llama-server"), "-m", args.model, "-t", args.threads,
                                       "-np", args.clients, "-cb", "-c", args.clients * ctx_per_slot,
                                       "--host", "127.0.0.1", "--port", port],
            "tessera": lambda port: [args.tessera, "serve", "--config", args.serve_config,
                                     "--host", "127.0.0.1", "--port", port],
        }
        for r in range(args.serve_rounds):
            for name, cmd in servers.items():
                port = free_port()
                url = f"http://127.0.0.1:{port}"
                log_path = Path(tmp) / f"{name}.log"
                proc = subprocess.Popen([str(c) for c in cmd(port)], stdout=open(log_path, "w"),
                                        stderr=subprocess.STDOUT)
                try:
                    wait_healthy(url, proc)
                    rounds[name].append(bench_serve(args.tessera, url, workload, args.clients, args.requests))
                finally:
                    stop(proc)
                log(f"serving round {r + 1}/{args.serve_rounds}, {name}: "
                    f"{rounds[name][-1]['output_tokens_per_s']:.1f} output t/s")
    return rounds


# ----------------------------------------------------------------------------- report


def display_path(p: Path) -> str:
    try:
        return str(p.resolve().relative_to(ROOT))
    except ValueError:
        return str(p)


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def spread(xs):
    return f"{min(xs):.1f}–{max(xs):.1f}" if xs else "–"


def table(lat: dict | None, srv: dict | None, args) -> str:
    lines = []
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    lines.append(f"Measured {stamp} by `bench/peer_llama_cpp.py {' '.join(sys.argv[1:])}` "
                 f"(llama.cpp from llama-cpp-python {PEER_VERSION}, GGML_NATIVE; "
                 f"{args.model.name}; {args.threads} threads).")
    lines.append("")
    if lat:
        m = lat["machine"]
        lines.append(f"Machine limits measured by `tessera bench latency`: DRAM read "
                     f"{m['read_bandwidth_gb_s']:.1f} GB/s, FP32 FMA peak {m['fma_peak_gflop_s']:.0f} GFLOP/s "
                     f"→ decode roofline {lat['tg_roofline']:.0f} t/s, prefill roofline {lat['pp_roofline']:.0f} t/s.")
        lines.append("")
        lines.append("| test | llama.cpp t/s (median, range) | Tessera t/s (median, range) | Tessera / llama.cpp | target | Tessera as % of roofline |")
        lines.append("|---|---|---|---|---|---|")
        for k, label, roof in (("pp", f"pp{lat['pp']}", lat["pp_roofline"]), ("tg", f"tg{lat['tg']}", lat["tg_roofline"])):
            p, t = lat["rounds"]["llama.cpp"][k], lat["rounds"]["tessera"][k]
            ratio = median(t) / median(p)
            lines.append(f"| {label} | {median(p):.1f} ({spread(p)}) | {median(t):.1f} ({spread(t)}) | "
                         f"{ratio:.2f}× | ≥ 1.5× {'met' if ratio >= 1.5 else 'missed'} | {100 * median(t) / roof:.0f}% |")
        lines.append("")
    if srv:
        lines.append(f"Serving: {args.clients} concurrent streaming clients, {args.requests} requests of "
                     f"≈128 prompt tokens and {args.out_tokens} output tokens (`tessera bench serve`); "
                     f"llama-server `-np {args.clients} -cb`, Tessera `{display_path(args.serve_config)}`; "
                     f"{len(srv['tessera'])} rounds, each llama.cpp then Tessera, medians over rounds.")
        lines.append("")
        lines.append("| server | ok/sent (all rounds) | output t/s (median, range) | TTFT p50 / p99 ms | TPOT p50 / p99 ms | ITL p99 ms |")
        lines.append("|---|---|---|---|---|---|")
        for name, runs in srv.items():
            def med(key):
                return median([m[key] for m in runs])
            tput = [m["output_tokens_per_s"] for m in runs]
            lines.append(f"| {name} | {sum(m['completed'] for m in runs)}/{sum(m['requests'] for m in runs)} | "
                         f"{median(tput):.1f} ({spread(tput)}) | {med('ttft_p50_ms'):.0f} / {med('ttft_p99_ms'):.0f} | "
                         f"{med('tpot_p50_ms'):.1f} / {med('tpot_p99_ms'):.1f} | {med('itl_p99_ms'):.1f} |")
        a, b = srv["tessera"], srv["llama.cpp"]
        if a and len(a) == len(b):
            ratios = [x["output_tokens_per_s"] / y["output_tokens_per_s"] for x, y in zip(a, b)]
            ratio = median(ratios)
            tpot_a = median([m["tpot_p99_ms"] for m in a])
            tpot_b = median([m["tpot_p99_ms"] for m in b])
            lines.append("")
            lines.append(f"Output tokens/s Tessera / llama.cpp: **{ratio:.2f}×** median of the rounds' ratios "
                         f"({', '.join(f'{x:.2f}×' for x in ratios)}; target ≥ 3×: "
                         f"{'met' if ratio >= 3 else 'missed'}); p99 TPOT {tpot_a:.1f} vs "
                         f"{tpot_b:.1f} ms ({'lower' if tpot_a < tpot_b else 'not lower'}).")
    return "\n".join(lines) + "\n"


def write_docs(text: str, begin: str = DOCS_BEGIN, end: str = DOCS_END,
               heading: str = "Side by side with llama.cpp (peer script)") -> None:
    path = ROOT / "docs" / "benchmarks.md"
    doc = path.read_text()
    block = f"{begin}\n{text}{end}"
    if begin in doc:
        doc = re.sub(re.escape(begin) + r".*?" + re.escape(end), lambda _: block, doc, flags=re.S)
    else:
        doc += f"\n## {heading}\n\n" + block + "\n"
    path.write_text(doc)
    log(f"updated {path}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["build", "latency", "serve", "all", "formats"])
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--tessera", type=Path, default=ROOT / "build" / "bin" / "tessera")
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "smollm2-cpu.yaml",
                    help="stack for the latency runs")
    ap.add_argument("--serve-config", type=Path, default=ROOT / "configs" / "smollm2-cpu.yaml",
                    help="stack `tessera serve` runs")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("-r", "--repeats", type=int, default=3)
    ap.add_argument("--pp", type=int, default=512)
    ap.add_argument("--tg", type=int, default=128)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--serve-rounds", type=int, default=None,
                    help="serving rounds, each llama.cpp then Tessera (default: --repeats)")
    ap.add_argument("--out-tokens", type=int, default=128)
    ap.add_argument("--formats", type=lambda s: s.split(","), default=FORMATS,
                    help=f"llama-quantize types of the format sweep (default: {','.join(FORMATS)})")
    ap.add_argument("--format-dir", type=Path, default=CACHE / "formats",
                    help="where the requantized models are kept")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--json", type=Path, help="write the raw figures here")
    ap.add_argument("--write-docs", action="store_true", help="replace the table in docs/benchmarks.md")
    args = ap.parse_args()
    if args.serve_rounds is None:
        args.serve_rounds = args.repeats

    # Only what this command runs: the format sweep needs llama-bench and llama-quantize.
    targets = {"latency": ["llama-bench"], "formats": ["llama-bench", "llama-quantize"],
               "serve": ["llama-server"]}.get(args.what, ["llama-bench", "llama-server"])
    build_peer(args.jobs, targets)
    if args.what == "build":
        return 0
    if not args.model.exists():
        sys.exit(f"error: model {args.model} not found (run scripts/fetch-models.sh)")
    if not args.tessera.exists():
        sys.exit(f"error: {args.tessera} not found (run scripts/build.sh)")
    if args.what == "formats":
        text = formats_table(measure_formats(args), args)
        print(text)
        if args.write_docs:
            write_docs(text, "<!-- peer-llama-cpp-formats:begin -->", "<!-- peer-llama-cpp-formats:end -->",
                       "Weight formats side by side with llama.cpp (peer script)")
        return 0
    lat = measure_latency(args) if args.what in ("latency", "all") else None
    srv = measure_serving(args) if args.what in ("serve", "all") else None
    text = table(lat, srv, args)
    print(text)
    if args.json:
        args.json.write_text(json.dumps({"latency": lat, "serving": srv}, indent=2))
    if args.write_docs:
        write_docs(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
