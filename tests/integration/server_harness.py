"""Starts and stops a real `tessera serve` process for the server tests.

The server binds port 0 and prints the address it got; the harness reads it from stderr.
Tests skip (exit 77) when the real model or the Python client packages are missing, unless
TESSERA_REQUIRE_MODEL=1 (scripts/test.sh sets it), where that is a failure.
"""
import atexit
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

SOURCE_DIR = os.environ.get("TESSERA_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))
BUILD_DIR = os.environ.get("TESSERA_BUILD_DIR", os.path.join(SOURCE_DIR, "build"))
TESSERA = os.path.join(BUILD_DIR, "bin", "tessera")
DEFAULT_STACK = os.path.join(SOURCE_DIR, "configs", "smollm2-cpu.yaml")
SKIP = 77
# A sanitizer build (scripts/sanitize.sh sets TESSERA_SANITIZER) runs the server 2-15x slower:
# client-side request timeouts grow by the factor ctest's TIMEOUTs get there (x4).
TIMEOUT_SCALE = 4 if os.environ.get("TESSERA_SANITIZER") else 1


SCRATCH_DIRS = []  # every folder scratch_dir() made in this process, removed at exit


def scratch_dir(prefix):
    """A new folder under $TMPDIR for one test's files (a server's stack.yaml, a redis-server's
    working folder, outputs), removed when the test process exits, whatever the outcome:
    a suite run leaves nothing in /tmp. TESSERA_KEEP_TEST_FILES=1 keeps them for a post-mortem."""
    d = tempfile.mkdtemp(prefix=prefix)
    SCRATCH_DIRS.append(d)
    return d


def request_timeout(seconds):
    """A client timeout of `seconds` in a plain build, scaled in a sanitizer build."""
    return seconds * TIMEOUT_SCALE


def skip_or_fail(reason):
    if os.environ.get("TESSERA_REQUIRE_MODEL") == "1":
        print(f"FAIL: {reason}", file=sys.stderr)
        sys.exit(1)
    print(f"skipped: {reason}")
    sys.exit(SKIP)


def require_environment(modules=("openai", "httpx")):
    model_dir = os.environ.get("TESSERA_MODEL_DIR", os.path.expanduser("~/.cache/tessera/models"))
    model = os.path.join(model_dir, "SmolLM2-135M-Instruct.Q4_1.gguf")
    if not os.path.exists(model):
        skip_or_fail(f"the real model is missing at {model} (run scripts/fetch-models.sh)")
    for m in modules:
        try:
            __import__(m)
        except ImportError:
            skip_or_fail(f"Python package '{m}' is missing (run scripts/install-deps.sh)")
    if not os.path.exists(TESSERA):
        skip_or_fail(f"{TESSERA} is not built")


class Server:
    """A `tessera serve` on a free port with the default stack plus `server_yaml` overrides."""

    def __init__(self, server_yaml="", env=None, name="server", args=()):
        self.dir = scratch_dir(f"tessera-{name}-")
        self.config = os.path.join(self.dir, "stack.yaml")
        with open(self.config, "w") as f:
            f.write(f"extends: {DEFAULT_STACK}\n")
            if server_yaml:
                f.write("server:\n")
                for line in server_yaml.strip().splitlines():
                    f.write(f"  {line}\n")
        self.env = dict(os.environ, **(env or {}))
        self.args = list(args)  # extra `tessera serve` options
        self.proc = None
        self.port = None
        self.stderr_lines = []
        STARTED_SERVERS.append(self)

    def start(self, timeout=120):
        self.proc = subprocess.Popen([TESSERA, "serve", "--config", self.config, "--port", "0"] + self.args,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     env=self.env)
        ready = threading.Event()

        def pump():
            for line in self.proc.stderr:
                self.stderr_lines.append(line)
                m = re.search(r"listening on http://[\d.]+:(\d+)", line)
                if m:
                    self.port = int(m.group(1))
                    ready.set()
            ready.set()

        threading.Thread(target=pump, daemon=True).start()
        # Loading repacks every weight: under a sanitizer that alone can outlast the plain
        # build's limit on a busy machine, so the limit scales like the clients' timeouts.
        if not ready.wait(request_timeout(timeout)) or self.port is None:
            self.proc.kill()
            raise RuntimeError("server did not start:\n" + "".join(self.stderr_lines))
        return self

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}"

    def stop(self, timeout=30):
        """SIGTERM, then the exit status (the server must exit 0 on a graceful shutdown)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return None

    def stop_and_check(self):
        """stop(), asserting the graceful exit status 0 (the stderr tail says why not)."""
        rc = self.stop()
        assert rc == 0, f"server exit status {rc}:\n" + "".join(self.stderr_lines[-20:])

    def openai_client(self, api_key="none", timeout=120):
        """The official client against this server, without retries (a failure shows at once)."""
        import openai
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0,
                             timeout=request_timeout(timeout))

    def metrics(self):
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            return r.read().decode()

    def metric(self, name):
        m = re.search(rf"^{re.escape(name)} ([-+\d.e]+)$", self.metrics(), re.M)
        return float(m.group(1)) if m else None

    def wait_for_metric(self, name, value, timeout=20 * TIMEOUT_SCALE):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.metric(name) == value:
                return True
            time.sleep(0.1)
        return False


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Redis:
    """A redis-server (Debian's package) on a free loopback port, persistence off."""

    def __init__(self):
        self.port = free_port()
        self.dir = scratch_dir("tessera-redis-")
        self.proc = None

    def start(self):
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self.dir],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        STARTED_HELPERS.append(self.proc)
        deadline = time.time() + 10
        while time.time() < deadline:
            try:
                if self.cli("PING") == "PONG":
                    return self
            except subprocess.CalledProcessError:
                pass
            time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def kill(self):
        self.proc.kill()
        self.proc.wait()

    def cli(self, *args):
        return subprocess.run(["redis-cli", "-p", str(self.port)] + list(args), check=True, capture_output=True,
                              text=True, timeout=10).stdout.strip()

    def keys(self):
        out = self.cli("--scan", "--pattern", "tessera:exact:*")
        return [k for k in out.splitlines() if k]

    def wait_for_new_key(self, before, timeout=10):
        """Until a key not in `before` (a set of keys) exists. Counting keys instead would race
        with the TTL: on a loaded machine earlier entries expire while one request runs."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if set(self.keys()) - before:
                return True
            time.sleep(0.05)
        return False

    def wait_for_keys(self, n, timeout=10):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if len(self.keys()) >= n:
                return True
            time.sleep(0.05)
        return False


class Gateway(Server):
    """A `tessera serve` with `yaml` as its whole config (deployments, gateway, server)."""

    def __init__(self, yaml, name):
        super().__init__(name=name)
        with open(self.config, "w") as f:
            f.write(yaml)


def stream_completion(url, body, result, on_text=None, headers=None):
    """POSTs a streamed /v1/completions (with usage in the last event) and fills `result`:
    status, pieces (the text of each event), finish (the last finish_reason), usage.
    `on_text` is called on the first and every later piece of text."""
    import json
    import httpx
    result.update(status=None, pieces=[], finish=None, usage=None)
    body = dict(body, stream=True, stream_options={"include_usage": True})
    with httpx.stream("POST", url + "/v1/completions", json=body, headers=headers or {}, timeout=300) as r:
        result["status"] = r.status_code
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            if event.get("usage"):
                result["usage"] = event["usage"]
            for choice in event.get("choices", []):
                if choice.get("text"):
                    result["pieces"].append(choice["text"])
                    if on_text is not None:
                        on_text()
                if choice.get("finish_reason"):
                    result["finish"] = choice["finish_reason"]


def run_tests(test_case_classes):
    """Runs unittest cases and prints the closing 'N passed, N failed' line."""
    import unittest
    suite = unittest.TestSuite()
    loader = unittest.TestLoader()
    for cls in test_case_classes:
        suite.addTests(loader.loadTestsFromTestCase(cls))
    result = unittest.TextTestRunner(verbosity=2, stream=sys.stdout).run(suite)
    failed = len(result.failures) + len(result.errors)
    print(f"{result.testsRun - failed} passed, {failed} failed")
    return 0 if failed == 0 else 1


def wait_until(predicate, timeout=20):
    """Polls `predicate` every 50 ms until it is true (True) or `timeout` seconds pass (False)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def longest_gap(times):
    """The longest wait between two consecutive timestamps (a stream's stall), 0 if < 2."""
    return max((b - a for a, b in zip(times, times[1:])), default=0.0)


STARTED_SERVERS = []  # every Server of this process, for print_crash_reports()
STARTED_HELPERS = []  # every other process a test started through this module (redis-server)


@atexit.register
def _kill_leftover_servers():
    """No server outlives its test: one that ends on an exception before its stop() calls (a
    failed step under a sanitizer, say) would otherwise leave its servers running, loading the
    CPUs under the tests after it. The same for a redis-server whose kill() was never reached."""
    for proc in [s.proc for s in STARTED_SERVERS] + STARTED_HELPERS:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
    # Then their folders: the processes that wrote there are gone.
    if os.environ.get("TESSERA_KEEP_TEST_FILES") != "1":
        for d in SCRATCH_DIRS:
            shutil.rmtree(d, ignore_errors=True)


def print_crash_reports(servers=None):
    """Prints why servers died: the sanitizer report in a server's stderr (a sanitizer build
    halts a server at its first report; the client then sees only a dropped connection), else
    the stderr tail of a server that exited abnormally (an abort's "terminate called ...", a
    failed assertion). A server the test SIGKILLed on purpose only gets its exit line."""
    time.sleep(1)  # the stderr pumps read what a halted server wrote last
    for s in STARTED_SERVERS if servers is None else servers:
        if s.proc is None or s.proc.poll() is None or s.proc.returncode == 0:
            continue
        name = os.path.basename(s.dir)
        print(f"--- {name} exited {s.proc.returncode}")
        lines = getattr(s, "stderr_lines", [])
        start = next((i for i, l in enumerate(lines) if "Sanitizer" in l and ("WARNING" in l or "ERROR" in l)), None)
        if start is not None:
            print(f"--- sanitizer report of {name}:\n" + "".join(lines[start:start + 80]))
        elif s.proc.returncode != -signal.SIGKILL:
            print(f"--- the last lines {name} wrote to stderr:\n" + "".join(lines[-30:]))


class Checks:
    """Named checks of a scripted end-to-end test: each prints "ok" or "FAIL" with what it
    checked as it runs (the log reads as the test's report); finish() exits 1 if any failed."""

    def __init__(self):
        self.failures = []

    def __call__(self, ok, what):
        print(("ok   " if ok else "FAIL ") + what, flush=True)
        if not ok:
            self.failures.append(what)

    def finish(self, what):
        if self.failures:
            print(f"{len(self.failures)} check(s) failed")
            sys.exit(1)
        print(f"all {what} checks passed")
