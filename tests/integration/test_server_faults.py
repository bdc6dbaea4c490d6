"""Faults around `tessera serve`: a client that stops reading its stream, SIGTERM while a long
prompt is being prefilled (finished in time, and cut off by the shutdown timeout), and a full
disk under `tessera bench` / `tessera eval` reports (no half-written file, a clear error).

Each fault must cost only the affected request: the others complete, no KV block stays held,
and the server exits 0 on SIGTERM.
"""
import json
import os
import socket
import subprocess
import sys
import threading
import time
import unittest

sys.path.insert(0, os.path.dirname(__file__))
import server_harness as h  # noqa: E402

h.require_environment(modules=("httpx",))
import httpx  # noqa: E402

# About 1,800 prompt tokens (the default stack's context is 2048): seconds of prefill on 2
# cores, so a signal sent once the request is in flight arrives during the prefill.
LONG_PROMPT = " ".join(f"Item {i} is a {['red', 'green', 'blue'][i % 3]} box." for i in range(185))


def model_of(server):
    return httpx.get(server.url + "/v1/models").json()["data"][0]["id"]


class StalledReader(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.server = h.Server("write_timeout: 2s", name="faults-stall").start()
        cls.model = model_of(cls.server)

    @classmethod
    def tearDownClass(cls):
        cls.server.stop()

    def test_a_client_that_stops_reading_is_cut_off_and_costs_nobody_else(self):
        # 8 samples with 20 alternatives per token: ~12 MB of events, far more than the
        # kernel's socket buffers (tcp_wmem's 4 MB maximum by default, plus the tiny receive
        # window) can hold for a client that never reads, so the server's writes back up.
        body = json.dumps({"model": self.model, "prompt": "Count: one two three", "max_tokens": 1900,
                           "n": 8, "logprobs": 20, "ignore_eos": True, "temperature": 0.7, "seed": 1,
                           "stream": True}).encode()
        stalled = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        # A tiny receive window, and the client never reads: the server's writes back up.
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
        stalled.connect(("127.0.0.1", self.server.port))
        stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        try:
            self.assertTrue(self.server.wait_for_metric("tessera_requests_in_flight", 1), "the request never started")
            # Meanwhile another client is served normally.
            r = httpx.post(self.server.url + "/v1/completions", timeout=120,
                           json={"model": self.model, "prompt": "The sky is", "max_tokens": 8,
                                 "ignore_eos": True, "temperature": 0})
            self.assertEqual(r.status_code, 200)
            self.assertEqual(r.json()["usage"]["completion_tokens"], 8)
            # The stalled request is cancelled once a write waits past write_timeout, long
            # before its 8 x 1900 tokens could have been produced; its socket is still open.
            # How long filling the socket buffers takes depends on the machine's load (a few
            # thousand tokens first), so the wait is generous; what matters is asserted below:
            # it stopped before producing all its tokens.
            self.assertTrue(self.server.wait_for_metric("tessera_requests_in_flight", 0,
                                                     timeout=h.request_timeout(300)),
                            "the stalled request was never cut off")
            self.assertTrue(self.server.wait_for_metric("tessera_kv_blocks_used", 0, timeout=10))
            produced = (self.server.metric("tessera_generation_tokens_total") or 0) - 8
            print(f"stalled request cut off after {produced:.0f} of {8 * 1900} tokens")
            self.assertLess(produced, 8 * 1900)
        finally:
            stalled.close()
        r = httpx.get(self.server.url + "/health", timeout=10)
        self.assertEqual(r.status_code, 200)


class SigtermDuringPrefill(unittest.TestCase):
    def run_case(self, shutdown_timeout, extra=""):
        server = h.Server(f"shutdown_timeout: {shutdown_timeout}\n{extra}", name="faults-sigterm").start()
        self.addCleanup(server.stop)  # a failed assertion must not leave the server running
        model = model_of(server)
        result, first_token = {}, threading.Event()
        body = {"model": model, "prompt": LONG_PROMPT, "max_tokens": 16, "ignore_eos": True, "temperature": 0}
        t = threading.Thread(target=h.stream_completion, args=(server.url, body, result, first_token.set))
        t.start()
        self.assertTrue(server.wait_for_metric("tessera_requests_in_flight", 1), "the request never arrived")
        self.assertFalse(first_token.is_set(), "the prompt was already computed: the signal would miss the prefill")
        t0 = time.time()
        # Scaled like the shutdown_timeout below: under a sanitizer the server may take up to
        # 240 s to finish the prefill, and an unscaled 120 s wait killed it first (ASan, -j2).
        rc = server.stop(timeout=h.request_timeout(120))
        t.join(timeout=h.request_timeout(120))
        return server, result, rc, time.time() - t0

    def test_in_flight_prefill_finishes_before_exit(self):
        # 60 s (x4 under a sanitizer, whose prefill of ~1,800 tokens is that much slower).
        server, result, rc, _ = self.run_case(f"{h.request_timeout(60)}s")
        self.assertEqual(rc, 0, "".join(server.stderr_lines[-10:]))
        self.assertEqual(result["status"], 200)
        self.assertEqual(result["finish"], "length")
        self.assertEqual(result["usage"]["completion_tokens"], 16)
        self.assertGreater(result["usage"]["prompt_tokens"], 1500)

    def test_prefill_cut_by_the_shutdown_timeout_ends_as_abort_and_exits_0(self):
        server, result, rc, seconds = self.run_case("300ms")
        self.assertEqual(rc, 0, "".join(server.stderr_lines[-10:]))
        self.assertEqual(result["status"], 200)  # the stream had started; it ends cleanly
        self.assertEqual(result["finish"], "abort")
        self.assertLess(len(result["pieces"]), 16)
        self.assertLess(seconds, 60)


    def test_a_step_outlasting_the_grace_still_ends_the_stream_as_abort(self):
        # shutdown_grace 0: the cancelled request's prefill step is still running when the
        # grace ends, so the server completes the response itself: an "abort" chunk and [DONE],
        # not a cut connection; the process exits 0.
        server, result, rc, seconds = self.run_case("100ms", "shutdown_grace: 0s")
        self.assertEqual(rc, 0, "".join(server.stderr_lines[-10:]))
        self.assertEqual(result["status"], 200)
        self.assertEqual(result["finish"], "abort")
        self.assertLess(len(result["pieces"]), 16)
        self.assertTrue(any("ending them as aborted" in line for line in server.stderr_lines),
                        "".join(server.stderr_lines[-10:]))
        self.assertLess(seconds, 60)


class FullDisk(unittest.TestCase):
    """A file size limit (RLIMIT_FSIZE, SIGXFSZ ignored) makes every write past it fail with
    EFBIG, as a full disk fails with ENOSPC: the command must fail clearly and leave no file."""

    def run_limited(self, args, cwd):
        def limit():
            import resource
            import signal
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))
        return subprocess.run([h.TESSERA] + args, cwd=cwd, preexec_fn=limit, capture_output=True, text=True,
                              timeout=600)

    def check_no_file_left(self, directory, name):
        leftovers = [f for f in os.listdir(directory) if name in f]
        self.assertEqual(leftovers, [], f"half-written files left: {leftovers}")

    def test_bench_workload_on_a_full_disk(self):
        d = h.scratch_dir("tessera-fulldisk-")
        p = self.run_limited(["bench", "make-workload", "--kind", "mixed", "-n", "64", "--output",
                              os.path.join(d, "workload.jsonl")], d)
        self.assertNotEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn("cannot write", p.stderr)
        self.assertIn("workload.jsonl", p.stderr)
        self.assertIn("File too large", p.stderr)
        self.check_no_file_left(d, "workload.jsonl")

    def test_bench_report_on_a_full_disk_leaves_the_old_report(self):
        d = h.scratch_dir("tessera-fulldisk-")
        report = os.path.join(d, "report.html")
        with open(report, "w") as f:
            f.write("old report\n")
        p = self.run_limited(["bench", "latency", "--config", h.DEFAULT_STACK, "--prompt-tokens", "16",
                              "--gen-tokens", "4", "--repetitions", "1", "--html", report], d)
        self.assertNotEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn("cannot write", p.stderr)
        self.assertIn("File too large", p.stderr)
        with open(report) as f:
            self.assertEqual(f.read(), "old report\n")
        self.assertEqual(os.listdir(d), ["report.html"])


if __name__ == "__main__":
    sys.exit(h.run_tests([StalledReader, SigtermDuringPrefill, FullDisk]))
