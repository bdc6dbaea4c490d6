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
  bench/peer_llama_cpp.py spec -r 3 --write-docs      # llama-lookup / llama-speculative-simple
                                                      # beside Tessera's drafters, batch 1

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

import make_spec_workloads  # bench/, beside this script: the spec comparison's prompts

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


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def isa_flags() -> list[str]:
    """GGML_NATIVE, except where the CPU reports AMX: -march=native then compiles ggml's AMX
    kernels, and on the virtual machines seen here (AMX listed in /proc/cpuinfo but tile state
    not usable) their first `ldtilecfg` kills llama-bench with SIGSEGV. There the build names
    every other instruction set the CPU has that these models use (AVX2/FMA/F16C/BMI2, AVX-512F,
    VBMI, VNNI, AVX-VNNI; not AVX512-BF16, whose tinyBLAS path does not compile with GCC 12
    outside -march=native)."""
    flags = cpu_flags()
    if "amx_tile" not in flags:
        return ["-DGGML_NATIVE=ON"]
    isa = ["-DGGML_NATIVE=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF",
           "-DGGML_AVX512_BF16=OFF"]
    # Named explicitly, not left to their defaults: a build folder first configured with
    # GGML_NATIVE=ON has them cached OFF.
    for cpu, option in (("sse4_2", "GGML_SSE42"), ("avx", "GGML_AVX"), ("avx2", "GGML_AVX2"),
                        ("fma", "GGML_FMA"), ("f16c", "GGML_F16C"), ("bmi2", "GGML_BMI2"),
                        ("avx512f", "GGML_AVX512"), ("avx512vbmi", "GGML_AVX512_VBMI"),
                        ("avx512_vnni", "GGML_AVX512_VNNI"), ("avx_vnni", "GGML_AVX_VNNI")):
        isa.append(f"-D{option}={'ON' if cpu in flags else 'OFF'}")
    return isa


def build_peer(jobs: int, targets: list[str]) -> None:
    stamp = peer_dir() / "build" / "tessera-isa-flags"
    if all(peer_bin(t).exists() for t in targets) and stamp.exists() and \
            stamp.read_text() == " ".join(isa_flags()):
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
         "-DCMAKE_BUILD_TYPE=Release", *isa_flags(), "-DLLAMA_CURL=OFF",
         "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=ON", "-DLLAMA_BUILD_TOOLS=ON",
         "-DLLAMA_BUILD_SERVER=ON", f"-DCMAKE_RUNTIME_OUTPUT_DIRECTORY={build / 'bin'}"])
    run(["cmake", "--build", build, "-j", str(jobs), "--target", *targets])
    stamp.write_text(" ".join(isa_flags()))


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

FORMATS = ["Q4_1", "Q4_0", "Q8_0", "Q4_K_M", "Q5_K_M", "Q6_K", "Q5_0"]


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


# ----------------------------------------------------------------------------- speculative decoding

SPEC_TOKENS = 96  # as bench/make_spec_workloads.py's workloads


def peer_spec_once(tool: str, model: Path, draft: Path | None, text: str, k: int, threads: int) -> dict:
    """One prompt through llama-lookup (prompt lookup; k = 0 decodes without drafts, the same
    loop) or llama-speculative-simple (a draft model), greedy, SPEC_TOKENS tokens."""
    cmd = [peer_bin(tool), "-m", model, "-p", make_spec_workloads.chat(text), "-n", SPEC_TOKENS, "-t", threads, "-c", 2048,
           "--temp", 0, "--ignore-eos", "--spec-draft-n-max", k]
    if draft is not None:
        cmd += ["-md", draft, "-td", threads, "--spec-type", "draft-simple"]
    out = run(cmd, capture_output=True, text=True)
    log_text = out.stdout + out.stderr
    m = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds, speed:\s+([\d.]+) t/s", log_text)
    if m is None:
        raise RuntimeError(f"{tool}: no 'decoded N tokens' line in its output:\n{log_text[-2000:]}")
    drafted = re.search(r"n_drafted\s*=\s*(\d+)", log_text)
    accepted = re.search(r"n_accept\s*=\s*(\d+)", log_text)
    return {"tokens": int(m.group(1)), "seconds": float(m.group(2)), "tok_s": float(m.group(3)),
            "drafted": int(drafted.group(1)) if drafted else 0, "accepted": int(accepted.group(1)) if accepted else 0}


def tessera_spec_once(tessera: Path, config: Path, texts: list[str], tmp: Path) -> list[dict]:
    """The prompts through `tessera generate --chat --json` on `config` (a batch-1 stack, so
    they run one at a time), greedy, SPEC_TOKENS tokens each; decode tokens/s per request from
    its own timings, as llama.cpp's 'decoded' line counts from the first generated token."""
    prompts = tmp / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": str(i), "prompt": t}) + "\n" for i, t in enumerate(texts)))
    out = run([tessera, "generate", "-c", config, "-f", prompts, "--chat", "--json", "--temperature", 0,
               "--ignore-eos", "--max-tokens", SPEC_TOKENS], capture_output=True, text=True).stdout
    res = []
    for line in out.splitlines():
        j = json.loads(line)
        t = j["timings"]
        n = len(j["tokens"])
        decode_s = t["e2e_s"] - t["ttft_s"]
        spec = j.get("speculative", {})
        res.append({"tokens": n, "seconds": decode_s, "tok_s": (n - 1) / decode_s if decode_s > 0 else 0.0,
                    "drafted": spec.get("draft_tokens", 0), "accepted": spec.get("accepted_tokens", 0)})
    return res


def f32_target(args) -> Path:
    """An F32 copy of the default model written by `tessera quantize` (cached beside it): the
    draft-model target, so that the Q4_1 file is a cheaper draft with the same vocabulary."""
    out = args.model.with_name(args.model.name.replace(".Q4_1.gguf", ".F32.gguf"))
    if not out.exists():
        run([args.tessera, "quantize", args.model, out, "--type", "F32"], stdout=subprocess.DEVNULL)
    return out


def num_draft_tokens(tessera: Path, config: Path) -> int:
    """The drafter's num_draft_tokens in a bench stack as `tessera config check` resolves it
    (extends and defaults included), so llama-speculative-simple gets the same number of drafts
    as Tessera's draft-model row."""
    resolved = subprocess.run([str(tessera), "config", "check", str(config)], check=True,
                              capture_output=True, text=True).stdout
    m = re.search(r"engine\.drafter:.*\bnum_draft_tokens=(\d+)", resolved)
    if m is None:
        raise SystemExit(f"{config}: its resolved drafter has no num_draft_tokens:\n{resolved}")
    return int(m.group(1))


def measure_spec(args) -> dict:
    """--repeats rounds; in each, every case runs its prompts once, llama.cpp then Tessera, so
    the ratios compare neighbouring runs. A case is (workload, what drafts): plain decoding,
    prompt lookup (llama-lookup vs drafter.ngram and drafter.suffix), a draft model
    (llama-speculative-simple vs drafter.draft-model, Q4_1 drafting for an F32 target)."""
    prompts = make_spec_workloads.user_messages(args.spec_prompts)
    f32 = f32_target(args)
    cfg = ROOT / "configs" / "bench"
    k = args.spec_k
    draft_k = num_draft_tokens(args.tessera, cfg / "spec-draft-model-f32.yaml")
    cases = []
    for workload in ("input-grounded", "chat"):
        cases += [
            (workload, "plain", ("llama-lookup", args.model, None, 0), cfg / "spec-off.yaml"),
            (workload, "prompt lookup", ("llama-lookup", args.model, None, k), cfg / "spec-ngram.yaml"),
            (workload, "suffix", None, cfg / "spec-suffix.yaml"),
            (workload, "layer-skip", None, cfg / "spec-layer-skip.yaml"),
        ]
    cases += [
        ("chat", "F32 target, plain", ("llama-lookup", f32, None, 0), cfg / "spec-draft-target-f32.yaml"),
        ("chat", "F32 target, Q4_1 draft model", ("llama-speculative-simple", f32, args.model, draft_k),
         cfg / "spec-draft-model-f32.yaml"),
    ]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        rows = {(w, what): {"llama.cpp": [], "tessera": [], "peer_acc": [], "tessera_acc": []} for w, what, _, _ in cases}
        loads = []
        for r in range(args.repeats):
            loads.append(loadavg())
            log(f"spec round {r + 1}/{args.repeats} (load {loads[-1]})")
            for workload, what, peer, config in cases:
                row = rows[(workload, what)]
                if peer is not None:
                    tool, model, draft, kk = peer
                    runs = [peer_spec_once(tool, model, draft, t, kk, args.threads) for t in prompts[workload]]
                    row["llama.cpp"].append(median([x["tok_s"] for x in runs]))
                    d = sum(x["drafted"] for x in runs)
                    row["peer_acc"].append((sum(x["accepted"] for x in runs), d))
                runs = tessera_spec_once(args.tessera, config, prompts[workload], Path(tmp))
                row["tessera"].append(median([x["tok_s"] for x in runs]))
                row["tessera_acc"].append((sum(x["accepted"] for x in runs), sum(x["drafted"] for x in runs)))
        for (workload, what), row in rows.items():
            results.append({"workload": workload, "drafts": what, **row})
    return {"rows": results, "load": loads, "k": k, "draft_k": draft_k, "prompts": args.spec_prompts,
            "f32": str(f32)}


def spec_table(res: dict, args) -> str:
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    lines = [f"Measured {stamp} by `bench/peer_llama_cpp.py {' '.join(sys.argv[1:])}`: batch 1, greedy, "
             f"{SPEC_TOKENS} tokens per prompt (`--ignore-eos`), {res['prompts']} prompts per workload (the "
             f"user messages of `bench/make_spec_workloads.py`, chat-formatted by each side), {args.threads} "
             f"threads, {args.repeats} rounds, each case llama.cpp then Tessera; load average per round "
             f"{', '.join(res['load'])}. llama.cpp: `llama-lookup` (its n-gram cache over prompt and output, "
             f"`--spec-draft-n-max {res['k']}`; `--spec-draft-n-max 0` is the plain row, the same loop "
             f"without drafts) and `llama-speculative-simple` (`-md` the Q4_1 file, {res['draft_k']} drafts); Tessera: "
             f"`tessera generate --chat --json` on the `configs/bench/spec-*.yaml` stacks. Figures are the "
             f"median over prompts of each request's decode tokens/s, then the median over rounds; speedup "
             f"is against the same tool's plain row.", ""]
    lines.append("| workload | drafts | llama.cpp tok/s | llama.cpp speedup | llama.cpp accepted / drafted | "
                 "Tessera tok/s | Tessera speedup | Tessera accepted / drafted | Tessera / llama.cpp |")
    lines.append("|---|---|---|---|---|---|---|---|---|")
    by_key = {(r["workload"], r["drafts"]): r for r in res["rows"]}

    def acc(pairs):
        a, d = sum(p[0] for p in pairs), sum(p[1] for p in pairs)
        return f"{a} / {d} ({100.0 * a / d:.0f} %)" if d else "–"

    for r in res["rows"]:
        base = by_key[(r["workload"], "F32 target, plain" if r["drafts"].startswith("F32") else "plain")]
        p, t = median(r["llama.cpp"]), median(r["tessera"])
        pb, tb = median(base["llama.cpp"]), median(base["tessera"])
        peer_cells = [f"{p:.1f} ({spread(r['llama.cpp'])})", f"{p / pb:.2f}×", acc(r["peer_acc"])] \
            if r["llama.cpp"] else ["–", "–", "–"]
        lines.append("| " + " | ".join([r["workload"], r["drafts"], *peer_cells,
                                         f"{t:.1f} ({spread(r['tessera'])})", f"{t / tb:.2f}×",
                                         acc(r["tessera_acc"]),
                                         f"{t / p:.2f}×" if r["llama.cpp"] else "–"]) + " |")
    return "\n".join(lines) + "\n"


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
    ap.add_argument("what", choices=["build", "latency", "serve", "all", "formats", "spec"])
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
    ap.add_argument("--spec-prompts", type=int, default=8, help="prompts per workload of the spec comparison")
    ap.add_argument("--spec-k", type=int, default=8, help="most drafts per step of the prompt-lookup rows")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--json", type=Path, help="write the raw figures here")
    ap.add_argument("--write-docs", action="store_true", help="replace the table in docs/benchmarks.md")
    args = ap.parse_args()
    if args.serve_rounds is None:
        args.serve_rounds = args.repeats

    # Only what this command runs: the format sweep needs llama-bench and llama-quantize.
    targets = {"latency": ["llama-bench"], "formats": ["llama-bench", "llama-quantize"],
               "serve": ["llama-server"], "spec": ["llama-lookup", "llama-speculative-simple"],
               "build": ["llama-bench", "llama-server", "llama-quantize", "llama-imatrix", "llama-perplexity"]}.get(
                   args.what, ["llama-bench", "llama-server"])
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
    if args.what == "spec":
        res = measure_spec(args)
        text = spec_table(res, args)
        print(text)
        if args.json:
            args.json.write_text(json.dumps(res, indent=2))
        if args.write_docs:
            write_docs(text, "<!-- peer-llama-cpp-spec:begin -->", "<!-- peer-llama-cpp-spec:end -->",
                       "Speculative decoding beside llama.cpp's lookup and speculative-simple (peer script)")
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
