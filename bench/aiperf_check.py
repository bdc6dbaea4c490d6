#!/usr/bin/env python3
"""NVIDIA AIPerf against `tessera serve` with the exported tokenizer (issue 16 acceptance):
runs `aiperf profile` (streamed completions) with `--tokenizer` at the directory
`tessera tokenizer export` writes, and checks that every request succeeded, that AIPerf
printed no warning about token counts, that its input sequence lengths are the requested
ones, and that it scraped the server's /metrics (server_metrics_export.json holds tessera_*
families).

AIPerf 0.13.0 pulls 72 packages and pins prometheus-client 0.23.1 (the tests pin 0.21.1), so
it lives in its own virtual environment, made on first use (about 6 minutes):

    bench/aiperf_check.py [--venv build/aiperf-venv] [--requests 16] [--concurrency 4]
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "integration"))
import server_harness as h  # noqa: E402  (starts `tessera serve` on a free port, default stack)

TESSERA = h.TESSERA
MODEL = os.path.join(os.environ.get("TESSERA_MODEL_DIR", os.path.expanduser("~/.cache/tessera/models")),
                     "SmolLM2-135M-Instruct.Q4_1.gguf")
AIPERF_VERSION = "0.13.0"
# Warnings AIPerf prints whatever the server: a GPU telemetry endpoint
# that this CPU machine has not (and its telemetry service missing heartbeats), and its own
# event loop running late on a busy machine.
BENIGN = re.compile(r"GPU Telemetry|gpu_telemetry_manager|Event loop for .* is taking too long")


def ensure_venv(venv):
    aiperf = os.path.join(venv, "bin", "aiperf")
    if not os.path.exists(aiperf):
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
        subprocess.run([os.path.join(venv, "bin", "pip"), "install", "--quiet", f"aiperf=={AIPERF_VERSION}"], check=True)
    return aiperf


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--venv", default=os.path.join(ROOT, "build", "aiperf-venv"))
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--isl", type=int, default=64)
    ap.add_argument("--osl", type=int, default=24)  # exactly: ignore_eos is sent (vLLM's extension)
    args = ap.parse_args()
    aiperf = ensure_venv(args.venv)
    work = tempfile.mkdtemp(prefix="tessera-aiperf-")
    tok_dir = os.path.join(work, "tokenizer")
    subprocess.run([TESSERA, "tokenizer", "export", MODEL, os.path.join(tok_dir, "tokenizer.json")], check=True)
    server = h.Server(name="aiperf", args=["--no-access-log"]).start()
    url = server.url
    failures = []
    try:
        model = json.load(urllib.request.urlopen(url + "/v1/models"))["data"][0]["id"]
        artifacts = os.path.join(work, "artifacts")
        start = time.time()
        run = subprocess.run([aiperf, "profile", "--model", model, "--url", url, "--endpoint-type", "completions",
                              "--tokenizer", tok_dir, "--streaming", "--concurrency", str(args.concurrency),
                              "--request-count", str(args.requests), "--isl", str(args.isl), "--osl", str(args.osl),
                              "--extra-inputs", "ignore_eos:true",
                              "--ui", "none", "--artifact-dir", artifacts], capture_output=True, text=True, timeout=900)
        print(run.stdout[-4000:])
        if run.returncode != 0:
            failures.append(f"aiperf exit status {run.returncode}: {run.stderr[-2000:]}")
        warnings = [l for l in (run.stdout + run.stderr).splitlines() if "WARNING" in l and not BENIGN.search(l)]
        failures += [f"warning: {w}" for w in warnings]
        export = json.load(open(os.path.join(artifacts, "profile_export_aiperf.json")))
        records = export.get("records", export)
        def metric(name):
            m = records.get(name) or {}
            return m.get("avg")
        isl, count, err = metric("input_sequence_length"), metric("request_count"), metric("error_request_count")
        print(f"aiperf {AIPERF_VERSION}: {count} requests in {time.time() - start:.1f} s, mean ISL {isl}, "
              f"errors {err or 0}")
        if count != args.requests:
            failures.append(f"request_count {count}, expected {args.requests}")
        if isl != args.isl:
            failures.append(f"mean input sequence length {isl}, expected {args.isl}")
        # AIPerf counted the prompts with the exported tokenizer; the server counted what it
        # fed the model (usage.prompt_tokens): equal when the export reproduces Tessera's ids.
        usage_prompt = metric("usage_prompt_tokens")
        print(f"server usage.prompt_tokens mean {usage_prompt} (AIPerf's own count: {isl})")
        if usage_prompt != isl:
            failures.append(f"server prompt tokens {usage_prompt} != AIPerf's count {isl}")
        scraped = open(os.path.join(artifacts, "server_metrics_export.json")).read()
        families = sorted(set(re.findall(r"tessera_[a-z_]+", scraped)))
        print(f"/metrics scraped: {len(families)} tessera_* names in server_metrics_export.json")
        if "tessera_time_to_first_token_seconds" not in families:
            failures.append("server_metrics_export.json has no tessera_time_to_first_token_seconds")
    finally:
        if server.stop() != 0:
            failures.append("tessera serve did not exit 0 on SIGTERM")
    for f in failures:
        print("FAIL:", f)
    print(f"{0 if failures else 1} passed, {1 if failures else 0} failed")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
