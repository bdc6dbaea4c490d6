"""Robustness of `tessera serve` against bad and hostile clients (raw sockets and httpx).

Each case checks the documented answer and that a valid request right after it succeeds; at
the end no KV block is held and SIGTERM shuts the server down with exit status 0.
The server runs with API keys, a small body limit, a short header deadline and a small queue.
"""
import json
import os
import socket
import sys
import threading
import time
import unittest
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(__file__))
import server_harness as h  # noqa: E402

h.require_environment(modules=("httpx",))
import httpx  # noqa: E402

KEY = "test-key-7f3a"
SERVER = None
MODEL = None
AUTH = {"Authorization": f"Bearer {KEY}"}


def setUpModule():
    global SERVER, MODEL
    SERVER = h.Server("api_keys: [other-key]\nmax_body_size: 4KiB\nheader_timeout: 1500ms\n"
                      "max_queued_requests: 3\nshutdown_timeout: 20s",
                      env={"TESSERA_API_KEYS": KEY}, name="robust").start()
    MODEL = httpx.get(SERVER.url + "/v1/models", headers=AUTH).json()["data"][0]["id"]


def tearDownModule():
    pass  # the last test stops the server


def post(path, body, headers=AUTH, **kw):
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(SERVER.url + path, content=data, headers={"Content-Type": "application/json", **headers},
                      timeout=120, **kw)


def completion(**kw):
    return {"model": MODEL, "prompt": "The sky is", "max_tokens": 4, "temperature": 0, **kw}


class Robustness(unittest.TestCase):
    def assert_error(self, r, status, param=None):
        self.assertEqual(r.status_code, status, r.text)
        err = r.json()["error"]
        self.assertEqual(set(err), {"message", "type", "param", "code"})
        self.assertTrue(err["message"])
        if param is not None:
            self.assertEqual(err["param"], param)
            self.assertIn(param, err["message"])
        return err

    def assert_server_healthy(self):
        r = post("/v1/completions", completion())
        self.assertEqual(r.status_code, 200, r.text)
        self.assertEqual(r.json()["choices"][0]["finish_reason"], "length")

    def test_01_malformed_json(self):
        self.assert_error(post("/v1/completions", b'{"model": "x", "prompt": '), 400)
        self.assert_error(post("/v1/chat/completions", b"[1, 2]"), 400)
        self.assert_server_healthy()

    def test_02_wrong_types_name_the_field(self):
        self.assert_error(post("/v1/completions", completion(max_tokens="ten")), 400, "max_tokens")
        self.assert_error(post("/v1/completions", completion(temperature="hot")), 400, "temperature")
        self.assert_error(post("/v1/completions", completion(temperature=3.5)), 400, "temperature")
        self.assert_error(post("/v1/completions", completion(stop=[1, 2])), 400, "stop")
        self.assert_error(post("/v1/completions", completion(stream="yes")), 400, "stream")
        self.assert_error(post("/v1/chat/completions", {"model": MODEL, "messages": "hi"}), 400, "messages")
        self.assert_error(post("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard",
                                                                                     "content": "x"}]}),
                          400, "messages[0].role")
        self.assert_error(post("/v1/completions", completion(logit_bias={"1": 5})), 400, "logit_bias")
        self.assert_server_healthy()

    def test_03_unknown_fields_are_ignored(self):
        r = post("/v1/completions", completion(some_future_option={"a": 1}, another=3))
        self.assertEqual(r.status_code, 200, r.text)

    def test_04_empty_messages_and_prompt(self):
        self.assert_error(post("/v1/chat/completions", {"model": MODEL, "messages": []}), 400, "messages")
        self.assert_error(post("/v1/completions", completion(prompt="")), 400, "prompt")
        self.assert_error(post("/v1/completions", {"model": MODEL}), 400, "prompt")
        self.assert_server_healthy()

    def test_05_routes_methods_models(self):
        self.assert_error(httpx.get(SERVER.url + "/v1/nothing", headers=AUTH), 404)
        r = httpx.get(SERVER.url + "/v1/completions", headers=AUTH)
        self.assert_error(r, 405)
        self.assertEqual(r.headers["allow"], "POST")
        err = self.assert_error(post("/v1/completions", completion(model="gpt-17")), 404, "model")
        self.assertEqual(err["code"], "model_not_found")
        self.assert_server_healthy()

    def test_06_api_keys(self):
        self.assert_error(post("/v1/completions", completion(), headers={}), 401)
        self.assert_error(post("/v1/completions", completion(), headers={"Authorization": "Bearer wrong"}), 401)
        self.assertEqual(httpx.get(SERVER.url + "/v1/models", headers={"Authorization": "Bearer other-key"})
                         .status_code, 200, "keys from the config and from TESSERA_API_KEYS both work")
        self.assertEqual(httpx.get(SERVER.url + "/health").status_code, 200, "/health needs no key")
        log = "".join(SERVER.stderr_lines)
        self.assertNotIn(KEY, log)
        self.assertNotIn("other-key", log)
        self.assert_server_healthy()

    def test_07_body_or_headers_over_the_limit(self):
        big = completion(prompt="word " * 2000)
        r = post("/v1/completions", big)
        self.assert_error(r, 413)
        r = post("/v1/completions", completion(), headers={**AUTH, "X-Padding": "p" * 20000})
        self.assert_error(r, 431)
        self.assert_server_healthy()

    def test_08_slow_headers_do_not_block_others_and_time_out(self):
        s = socket.create_connection(("127.0.0.1", SERVER.port))
        stop = threading.Event()
        closed_after = []

        def trickle():
            start = time.time()
            request = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" * 20
            try:
                for b in request:
                    if stop.is_set():
                        return
                    s.send(bytes([b]))
                    time.sleep(0.05)
            except OSError:
                closed_after.append(time.time() - start)

        t = threading.Thread(target=trickle)
        t.start()
        time.sleep(0.3)
        began = time.time()
        self.assert_server_healthy()  # served while the slow client is trickling
        self.assertLess(time.time() - began, 30)
        t.join(timeout=15)
        stop.set()
        # The header deadline (1.5 s) closed the connection long before the trickle ended.
        self.assertTrue(closed_after, "the slow client was never disconnected")
        self.assertLess(closed_after[0], 5)
        s.close()

    def test_09_client_disconnecting_mid_stream_cancels_its_request(self):
        before = SERVER.metric("tessera_requests_cancelled_by_client_total")
        s = socket.create_connection(("127.0.0.1", SERVER.port))
        body = json.dumps(completion(max_tokens=400, stream=True, ignore_eos=True)).encode()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        received = b""
        while received.count(b"data: ") < 3:
            chunk = s.recv(4096)
            self.assertTrue(chunk)
            received += chunk
        self.assertIn(b"200 OK", received)
        s.close()
        self.assertTrue(SERVER.wait_for_metric("tessera_requests_cancelled_by_client_total", before + 1))
        self.assertTrue(SERVER.wait_for_metric("tessera_requests_in_flight", 0))
        self.assertTrue(SERVER.wait_for_metric("tessera_kv_blocks_used", 0))
        self.assert_server_healthy()

    def test_10_disconnect_while_waiting_for_a_whole_response(self):
        s = socket.create_connection(("127.0.0.1", SERVER.port))
        body = json.dumps(completion(max_tokens=400, ignore_eos=True)).encode()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                  + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        time.sleep(0.5)
        s.close()
        self.assertTrue(SERVER.wait_for_metric("tessera_requests_in_flight", 0, timeout=10),
                        "closing the socket must cancel a non-streaming request too")
        self.assert_server_healthy()

    def test_11_burst_over_the_queue_limit_gets_429(self):
        def one(_):
            return post("/v1/completions", completion(max_tokens=16))

        with ThreadPoolExecutor(12) as pool:
            results = list(pool.map(one, range(12)))
        codes = sorted(r.status_code for r in results)
        self.assertIn(200, codes)
        self.assertIn(429, codes)
        self.assertEqual(set(codes), {200, 429}, codes)
        for r in results:
            if r.status_code == 429:
                self.assertEqual(r.json()["error"]["code"], "queue_full")
                self.assertEqual(r.headers["retry-after"], "1")
        self.assert_server_healthy()

    def test_12_keep_alive_serves_many_requests_on_one_connection(self):
        with httpx.Client(headers=AUTH, timeout=60) as c:
            for _ in range(3):
                r = c.post(SERVER.url + "/v1/completions", json=completion())
                self.assertEqual(r.status_code, 200)
            self.assertEqual(c.get(SERVER.url + "/health").status_code, 200)

    def test_13_metrics_and_no_block_left(self):
        self.assertTrue(SERVER.wait_for_metric("tessera_kv_blocks_used", 0))
        text = SERVER.metrics()
        for name in ("tessera_time_to_first_token_seconds_bucket", "tessera_time_per_output_token_seconds_count",
                     "tessera_inter_token_latency_seconds_sum", "tessera_queue_time_seconds_count",
                     "tessera_prefix_cache_hit_rate", "tessera_engine_preemptions_total",
                     "tessera_engine_batch_size", 'status="429"', 'status="413"', 'status="431"', 'status="401"'):
            self.assertIn(name, text)
        self.assertEqual(SERVER.metric("tessera_requests_in_flight"), 0)

    def test_14_sigterm_finishes_in_flight_requests_and_exits_0(self):
        # A streamed request, so the signal is sent once the request is known to be decoding
        # (polling a gauge can miss a short request on a fast machine).
        result = {}
        decoding = threading.Event()

        def long_request():
            h.stream_completion(SERVER.url, completion(max_tokens=24, ignore_eos=True), result,
                                on_text=decoding.set, headers=AUTH)
            decoding.set()

        t = threading.Thread(target=long_request)
        t.start()
        self.assertTrue(decoding.wait(60), "the request never started decoding")
        rc = SERVER.stop()
        t.join(timeout=60)
        self.assertEqual(rc, 0, "".join(SERVER.stderr_lines[-10:]))
        self.assertEqual(result.get("status"), 200)
        self.assertEqual(result["finish"], "length")
        self.assertEqual(result["usage"]["completion_tokens"], 24)


if __name__ == "__main__":
    sys.exit(h.run_tests([Robustness]))
