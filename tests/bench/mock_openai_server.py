#!/usr/bin/env python3
"""A minimal OpenAI-style /v1/completions server for testing `tessera bench serve`'s client:
streams max_tokens SSE events (one word each) as fast as it can, then a usage chunk and
[DONE]. It models no latency, so tests check counts and parsing, never timing.
Usage: mock_openai_server.py PORT_FILE  (binds an ephemeral port and writes it there)."""
import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path != "/v1/completions" or not body.get("stream"):
            self.send_response(400)
            msg = b'{"error": "expected a streamed /v1/completions"}'
            self.send_header("Content-Length", str(len(msg)))
            self.end_headers()
            self.wfile.write(msg)
            return
        n = int(body.get("max_tokens", 16))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

        def chunk(data):
            payload = ("data: " + data + "\n\n").encode()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(payload), payload))
            self.wfile.flush()

        for i in range(n):
            chunk(json.dumps({"object": "text_completion",
                              "choices": [{"index": 0, "text": " w%d" % i, "finish_reason": None}]}))
        chunk(json.dumps({"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": n}}))
        chunk("[DONE]")
        self.wfile.write(b"0\r\n\r\n")


server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
with open(sys.argv[1], "w") as f:
    f.write(str(server.server_address[1]))
server.serve_forever()
