"""Regression tests for the defects an adversarial probe found in `tessera serve` (issue 12)
and for HEAD responses (issue 16), on the default stack with the default 1 MiB body limit.

- a completions `prompt` nested 100k-500k levels deep (~1 MB) used to crash the server
  (SIGSEGV): now a 400 naming the field;
- a number that overflows a double (`max_tokens: 1e400`) used to end the process: now a 400
  naming the field;
- ambiguous HTTP framing (request smuggling) used to get 200: now 400 or 501, and the
  connection is closed;
- HEAD answers carry no body, so the next response on the connection parses.

Every case checks that the server still answers a normal request afterwards, and at the end
that the process is alive and exits 0 on SIGTERM.
"""
import json
import os
import socket
import sys
import unittest

sys.path.insert(0, os.path.dirname(__file__))
import server_harness as h  # noqa: E402

h.require_environment(modules=("httpx",))
import httpx  # noqa: E402

SERVER = None
MODEL = None


def setUpModule():
    global SERVER, MODEL
    SERVER = h.Server("header_timeout: 5s", name="hardening").start()
    MODEL = httpx.get(SERVER.url + "/v1/models").json()["data"][0]["id"]


def tearDownModule():
    rc = SERVER.stop()
    assert rc == 0, f"server exit status {rc}:\n" + "".join(SERVER.stderr_lines[-20:])


def post(path, data):
    if not isinstance(data, (bytes, str)):
        data = json.dumps(data)
    return httpx.post(SERVER.url + path, content=data, headers={"Content-Type": "application/json"}, timeout=120)


def raw_exchange(data, timeout=20):
    """Sends raw bytes, reads until the server closes the connection; returns all bytes."""
    s = socket.create_connection(("127.0.0.1", SERVER.port), timeout=timeout)
    try:
        s.sendall(data)
        out = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return out
            out += chunk
    finally:
        s.close()


def split_response(data):
    """(status, headers dict with lower-case names, rest after the header block)."""
    head, sep, rest = data.partition(b"\r\n\r\n")
    assert sep, f"no complete response header in {data[:200]!r}"
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers, rest


class Hardening(unittest.TestCase):
    def assert_error(self, r, status, param=None, contains=None):
        self.assertEqual(r.status_code, status, r.text[:500])
        err = r.json()["error"]
        self.assertEqual(set(err), {"message", "type", "param", "code"})
        if param is not None:
            self.assertEqual(err["param"], param, err)
            self.assertTrue(err["message"].startswith(param + ":"), err)
        if contains is not None:
            self.assertIn(contains, err["message"])
        return err

    def assert_server_healthy(self):
        self.assertIsNone(SERVER.proc.poll(), "the server process exited")
        r = post("/v1/completions", {"model": MODEL, "prompt": "The sky is", "max_tokens": 3, "temperature": 0})
        self.assertEqual(r.status_code, 200, r.text)
        self.assertEqual(r.json()["usage"]["completion_tokens"], 3)

    # --- issue 12, 1: nesting ------------------------------------------------------------
    def test_01_deeply_nested_prompt_is_a_400_not_a_crash(self):
        for depth in (100_000, 500_000):
            body = '{"model": "%s", "max_tokens": 2, "prompt": %s%s}' % (MODEL, "[" * depth, "]" * depth)
            self.assertLess(len(body), 1 << 20, "must be under the body limit to reach the parser")
            err = self.assert_error(post("/v1/completions", body), 400, "prompt", "nested deeper than")
            self.assertLess(len(err["message"]), 400)
            self.assert_server_healthy()

    def test_02_nesting_anywhere_is_bounded(self):
        deep = "[" * 200_000 + "]" * 200_000
        self.assert_error(post("/v1/completions", deep), 400, contains="nested deeper than")
        chat = '{"model": "%s", "messages": [{"role": "user", "content": %s}]}' % (MODEL, deep)
        self.assert_error(post("/v1/chat/completions", chat), 400, "messages", "nested deeper than")
        obj = '{"model": "%s", "prompt": "x", "extra": %s}' % (MODEL, '{"a":' * 100_000 + "1" + "}" * 100_000)
        self.assert_error(post("/v1/completions", obj), 400, "extra", "nested deeper than")
        # A few levels are fine (unknown fields are ignored).
        ok = '{"model": "%s", "prompt": "x", "max_tokens": 1, "extra": %s}' % (MODEL, "[" * 20 + "]" * 20)
        self.assertEqual(post("/v1/completions", ok).status_code, 200)
        self.assert_server_healthy()

    def test_03_a_token_list_holding_arrays_is_refused_without_printing_them(self):
        body = '{"model": "%s", "prompt": [[%s1%s]]}' % (MODEL, "[" * 50, "]" * 50)
        err = self.assert_error(post("/v1/completions", body), 400, "prompt[0]")  # a batch's first prompt
        self.assertNotIn("[[", err["message"])
        self.assert_server_healthy()

    # --- issue 12, 2: numbers out of range -----------------------------------------------
    def test_04_numbers_overflowing_a_double_name_the_field(self):
        base = '{"model": "%s", "prompt": "hi", ' % MODEL
        cases = [('"max_tokens": 1e400}', "max_tokens"),
                 ('"temperature": 1e400}', "temperature"),
                 ('"temperature": -1e400}', "temperature"),
                 ('"top_p": 1E+999}', "top_p"),
                 ('"seed": 1e400}', "seed"),
                 ('"stream": true, "stream_options": {"include_usage": 1e400}}', "stream_options.include_usage"),
                 ('"stop": ["a", 1e400]}', "stop[1]"),
                 ('"some_unknown_field": 1e400}', "some_unknown_field")]
        for tail, param in cases:
            with self.subTest(param=param):
                err = self.assert_error(post("/v1/completions", base + tail), 400, param, "out of range")
                self.assertEqual(err["type"], "invalid_request_error")
        chat = '{"model": "%s", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 1e400}'
        self.assert_error(post("/v1/chat/completions", chat % MODEL), 400, "max_completion_tokens")
        # Large but finite numbers are ordinary range errors.
        self.assert_error(post("/v1/completions", base + '"max_tokens": 1e300}'), 400, "max_tokens")
        self.assert_error(post("/v1/completions", base + '"max_tokens": 123456789012345678901234567890}'), 400,
                          "max_tokens")
        self.assert_server_healthy()

    # --- issue 12, 5: HTTP framing -------------------------------------------------------
    def framing_case(self, header_lines, body=b'{"model": "m", "prompt": "x"}', expect=400):
        head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        data = (head + "".join(line + "\r\n" for line in header_lines) + "\r\n").encode() + body
        status, headers, rest = split_response(raw_exchange(data))
        self.assertEqual(status, expect, (header_lines, rest[:300]))
        self.assertEqual(headers.get("connection"), "close", headers)
        self.assertIn("message", json.loads(rest)["error"])
        return json.loads(rest)["error"]["message"]

    def test_05_ambiguous_transfer_encodings_are_refused_and_the_connection_closed(self):
        n = len(b'{"model": "m", "prompt": "x"}')
        msg = self.framing_case(["Transfer-Encoding: xchunked", f"Content-Length: {n}"])
        self.assertIn("Transfer-Encoding", msg)
        self.framing_case([f"Content-Length: {n}", "Transfer-Encoding: xchunked"])
        self.framing_case(["Transfer-Encoding: xchunked"])
        self.framing_case(["Transfer-Encoding: chunked", f"Content-Length: {n}"])
        self.framing_case(["Transfer-Encoding: chunked, chunked"], body=b"0\r\n\r\n")
        self.framing_case(["Transfer-Encoding: chunked", "Transfer-Encoding: chunked"], body=b"0\r\n\r\n")
        self.framing_case(["Transfer-Encoding: chunked, gzip"], body=b"0\r\n\r\n")
        self.framing_case(['Transfer-Encoding: "chunked"'], body=b"0\r\n\r\n")
        msg = self.framing_case(["Transfer-Encoding: gzip, chunked"], body=b"0\r\n\r\n", expect=501)
        self.assertIn("chunked", msg)
        self.framing_case(["Transfer-Encoding: gzip", "Transfer-Encoding: chunked"], body=b"0\r\n\r\n", expect=501)
        self.assert_server_healthy()

    def test_06_obs_fold_and_conflicting_lengths_are_refused(self):
        n = len(b'{"model": "m", "prompt": "x"}')
        msg = self.framing_case(["X-Folded: first", " continued", f"Content-Length: {n}"])
        self.assertIn("obs-fold", msg)
        self.framing_case([f"Content-Length: {n}", "Transfer-Encoding: identity,", "\tchunked"])
        self.framing_case([f"Content-Length: {n}", f"Content-Length: {n + 1}"])
        self.framing_case([f"Content-Length: {n}, {n + 1}"])
        self.assert_server_healthy()

    def test_07_http10_with_transfer_encoding_is_refused(self):
        data = (b"POST /v1/completions HTTP/1.0\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n")
        status, _, _ = split_response(raw_exchange(data))
        self.assertEqual(status, 400)
        self.assert_server_healthy()

    def test_08_valid_chunked_and_content_length_bodies_still_work(self):
        body = json.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": 2, "temperature": 0}).encode()
        chunked = b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in (body[:10], body[10:])) + b"0\r\n\r\n"
        data = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Transfer-Encoding: Chunked\r\nConnection: close\r\n\r\n" + chunked)
        status, _, rest = split_response(raw_exchange(data))
        self.assertEqual(status, 200, rest[:300])
        data = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(body)}, {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
        status, _, rest = split_response(raw_exchange(data))
        self.assertEqual(status, 200, rest[:300])

    # --- issue 16, 6: HEAD ---------------------------------------------------------------
    def test_09_head_has_the_get_headers_and_no_body(self):
        for path in ("/health", "/v1/models", "/v1/models/" + MODEL, "/metrics"):
            with self.subTest(path=path):
                data = (f"HEAD {path} HTTP/1.1\r\nHost: x\r\n\r\n"
                        f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").encode()
                status, headers, rest = split_response(raw_exchange(data))
                self.assertEqual(status, 200)
                self.assertIn("content-length", headers)
                # The next bytes are the GET's response, not a HEAD body.
                self.assertTrue(rest.startswith(b"HTTP/1.1 200"), rest[:100])
                get_status, get_headers, get_body = split_response(rest)
                self.assertEqual(get_status, 200)
                self.assertEqual(len(get_body), int(get_headers["content-length"]))
                if path != "/metrics":  # the metrics text changes between the two requests
                    self.assertEqual(headers["content-length"], get_headers["content-length"])
                    self.assertEqual(headers["content-type"], get_headers["content-type"])
        r = httpx.head(SERVER.url + "/v1/completions")
        self.assertEqual(r.status_code, 405)
        self.assertEqual(r.content, b"")

    def test_99_still_alive(self):
        self.assert_server_healthy()
        log = "".join(SERVER.stderr_lines)
        self.assertNotIn("Segmentation", log)


if __name__ == "__main__":
    sys.exit(h.run_tests([Hardening]))
