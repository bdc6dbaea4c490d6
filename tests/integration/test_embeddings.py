"""POST /v1/embeddings and the semantic cache end to end, on the real models:

- the official `openai` client's `embeddings.create` against `tessera serve`: a string, a list
  of strings, token arrays, base64; the vectors match the committed sentence-transformers
  fixtures (cosine >= 1 - 1e-4); usage; errors naming the field (400) or the model (404);
- cache_layer.semantic: a paraphrase of an answered chat request is a hit that streams the
  original answer and says at what similarity; another tenant (user or API key), a
  non-reproducible request or an unrelated prompt is not; hits by tier and similarity
  bucket in /metrics;
- its Redis tier (a real redis-server, started by server_harness.Redis): an answer stored through
  one gateway process is a semantic hit (tier=redis) in another; Redis killed -> requests
  still served, errors counted; restarted -> sharing resumes.
"""
import base64
import json
import os
import struct
import sys
import unittest

sys.path.insert(0, os.path.dirname(__file__))
import server_harness as h  # noqa: E402

h.require_environment(modules=("openai", "httpx", "numpy"))
EMBEDDING_DIR = os.path.join(os.environ.get("TESSERA_MODEL_DIR", os.path.expanduser("~/.cache/tessera/models")),
                             "all-MiniLM-L6-v2")
if not os.path.exists(os.path.join(EMBEDDING_DIR, "model.safetensors")):
    h.skip_or_fail(f"the embedding model is missing at {EMBEDDING_DIR} (run scripts/fetch-models.sh)")
import httpx  # noqa: E402
import numpy as np  # noqa: E402
import openai  # noqa: E402

FIXTURE = os.path.join(h.SOURCE_DIR, "tests", "fixtures", "embedding", "all-minilm-l6-v2.json")
MODEL = "all-MiniLM-L6-v2"
THRESHOLD = 0.85


Gateway = h.Gateway


SERVER = None
CHAT_MODEL = None  # the stack's deployment (named after its model file)


def setUpModule():
    global SERVER, CHAT_MODEL
    SERVER = Gateway(f"""extends: {h.DEFAULT_STACK}
embedding: {{model: {{path: {MODEL}, threads: 2}}, max_inputs: 64}}
gateway:
  cache:
    - {{plugin: semantic, threshold: {THRESHOLD}, ttl: 1h, max_entries: 1000}}
""", "embeddings").start(timeout=240)
    CHAT_MODEL = SERVER.openai_client().models.list().data[0].id


def tearDownModule():
    if SERVER:
        SERVER.stop_and_check()


def cosine(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def metric_value(name, labels):
    total = 0.0
    for line in SERVER.metrics().splitlines():
        if line.startswith(name + "{"):
            head, value = line.rsplit(" ", 1)
            if all(f'{k}="{v}"' in head for k, v in labels.items()):
                total += float(value)
    return total


class Embeddings(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        with open(FIXTURE, encoding="utf-8") as f:
            cls.cases = [c for c in json.load(f)["cases"] if c["text"]]
        cls.client = SERVER.openai_client()

    def test_the_openai_client_gets_the_reference_embeddings(self):
        texts = [c["text"] for c in self.cases]
        r = self.client.embeddings.create(model=MODEL, input=texts)
        self.assertEqual(r.model, MODEL)
        self.assertEqual([d.index for d in r.data], list(range(len(texts))))
        for c, d in zip(self.cases, r.data):
            self.assertEqual(len(d.embedding), 384)
            self.assertGreaterEqual(cosine(d.embedding, c["embedding"]), 1 - 1e-4, c["text"][:40])
        self.assertEqual(r.usage.prompt_tokens, sum(len(c["ids"]) for c in self.cases))
        self.assertEqual(r.usage.total_tokens, r.usage.prompt_tokens)

    def test_a_single_string_token_arrays_and_base64(self):
        c = self.cases[1]
        one = self.client.embeddings.create(model=MODEL, input=c["text"])
        self.assertEqual(len(one.data), 1)
        ids = self.client.embeddings.create(model=MODEL, input=[c["ids"], self.cases[2]["ids"]])
        self.assertEqual(len(ids.data), 2)
        self.assertGreaterEqual(cosine(ids.data[0].embedding, one.data[0].embedding), 1 - 1e-6)
        self.assertEqual(ids.usage.prompt_tokens, len(c["ids"]) + len(self.cases[2]["ids"]))
        raw = httpx.post(SERVER.url + "/v1/embeddings",
                         json={"model": MODEL, "input": c["text"], "encoding_format": "base64"}, timeout=60).json()
        blob = base64.b64decode(raw["data"][0]["embedding"])
        floats = struct.unpack(f"<{len(blob) // 4}f", blob)
        self.assertEqual(len(floats), 384)
        self.assertGreaterEqual(cosine(floats, one.data[0].embedding), 1 - 1e-6)
        # Asked for explicitly, the client hands the base64 text back as it came. (Without
        # encoding_format it asks for base64 itself and decodes it: the test above.)
        text = self.client.embeddings.create(model=MODEL, input=c["text"], encoding_format="base64").data[0].embedding
        self.assertEqual(text, raw["data"][0]["embedding"])

    def test_errors_name_the_field_or_the_model(self):
        for body, field in [({"model": MODEL}, "input"), ({"model": MODEL, "input": ""}, "input"),
                            ({"model": MODEL, "input": ["a", ""]}, "input[1]"),
                            ({"model": MODEL, "input": [[101, 99999999]]}, "input"),
                            ({"model": MODEL, "input": [list(range(300))]}, "input"),
                            ({"model": MODEL, "input": ["x"] * 65}, "input"),
                            ({"model": MODEL, "input": "x", "encoding_format": "hex"}, "encoding_format"),
                            ({"model": MODEL, "input": "x", "dimensions": 128}, "dimensions"),
                            ({"input": "x"}, "model")]:
            r = httpx.post(SERVER.url + "/v1/embeddings", json=body, timeout=60)
            self.assertEqual(r.status_code, 400, (body, r.text))
            self.assertEqual(r.json()["error"]["param"], field, r.text)
        with self.assertRaises(openai.NotFoundError) as ctx:
            self.client.embeddings.create(model="text-embedding-3-small", input="x")
        self.assertIn(MODEL, str(ctx.exception))

    def test_the_model_list_has_the_embedding_model(self):
        ids = [m.id for m in self.client.models.list().data]
        self.assertIn(MODEL, ids)


def chat(content, user=None, key="none", **extra):
    """A chat request as the official client sends it (`Authorization: Bearer none`: the
    tenant is that key's digest and `user`)."""
    body = {"model": CHAT_MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 12,
            "temperature": 0, **extra}
    if user:
        body["user"] = user
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = httpx.post(SERVER.url + "/v1/chat/completions", json=body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    return r


class SemanticCache(unittest.TestCase):
    def test_a_paraphrase_is_a_hit_with_the_original_answer_and_its_similarity(self):
        first = chat("What is the capital of France?", user="alice")
        self.assertEqual(first.headers["x-tessera-cache"], "miss")
        second = chat("What's the capital city of France?", user="alice")
        header = second.headers["x-tessera-cache"]
        self.assertTrue(header.startswith("hit; layer=semantic; tier=memory; similarity="), header)
        similarity = float(header.rsplit("=", 1)[1])
        self.assertGreaterEqual(similarity, THRESHOLD)
        self.assertLess(similarity, 1.0)
        note = second.json()["tessera_cache"]
        self.assertEqual(note["layer"], "semantic")
        self.assertAlmostEqual(note["similarity"], similarity, places=3)
        self.assertEqual(second.json()["choices"][0]["message"]["content"],
                         first.json()["choices"][0]["message"]["content"])
        # Streamed like a model answer, through the official client.
        stream = SERVER.openai_client().chat.completions.create(
            model=CHAT_MODEL, messages=[{"role": "user", "content": "what is the capital of france"}],
            max_tokens=12, temperature=0, user="alice", stream=True)
        text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        self.assertEqual(text, first.json()["choices"][0]["message"]["content"])
        self.assertGreaterEqual(metric_value("tessera_cache_semantic_hits_total", {"tier": "memory"}), 2)

    def test_tenants_do_not_share_and_unrelated_or_sampled_requests_miss(self):
        chat("How many legs does a spider have?", user="bob")
        self.assertTrue(chat("How many legs do spiders have?", user="bob").headers["x-tessera-cache"].startswith("hit"))
        self.assertEqual(chat("How many legs do spiders have?", user="carol").headers["x-tessera-cache"], "miss")
        self.assertEqual(chat("How many legs do spiders have?", key="other", user="bob").headers["x-tessera-cache"],
                         "miss")  # the same user name behind another API key: another tenant
        self.assertEqual(chat("Write a haiku about autumn rain.", user="bob").headers["x-tessera-cache"], "miss")
        before = metric_value("tessera_cache_layer_skipped_total", {"layer": "semantic"})
        chat("How many legs do spiders have?", user="bob", temperature=0.8)
        self.assertEqual(metric_value("tessera_cache_layer_skipped_total", {"layer": "semantic"}), before + 1)


class SemanticRedisTier(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        import shutil
        if not shutil.which("redis-server"):
            raise unittest.SkipTest("redis-server is missing (run scripts/install-deps.sh)")
        cls.redis = h.Redis().start()
        yaml = f"""extends: {h.DEFAULT_STACK}
engine: {{kv_cache: {{plugin: paged, memory: 64MiB}}}}
embedding: {{model: {{path: {MODEL}, threads: 1}}}}
gateway:
  cache:
    - {{plugin: semantic, threshold: {THRESHOLD}, ttl: 1h, redis_url: "redis://127.0.0.1:{cls.redis.port}",
       redis_timeout: 200ms, redis_backoff_max: 300ms}}
"""
        cls.a = cls.b = None
        try:
            cls.a = Gateway(yaml, "semantic-a").start(timeout=240)
            cls.b = Gateway(yaml, "semantic-b").start(timeout=240)
        except Exception:
            if cls.a:
                cls.a.stop()
            cls.redis.kill()
            raise

    @classmethod
    def tearDownClass(cls):
        for g in (cls.a, cls.b):
            g.stop_and_check()
        cls.redis.kill()

    def post(self, server, content):
        model = server.openai_client().models.list().data[0].id
        r = httpx.post(server.url + "/v1/chat/completions", timeout=120,
                       json={"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 8,
                             "temperature": 0, "user": "dora"})
        self.assertEqual(r.status_code, 200, r.text)
        return r

    def test_an_answer_stored_by_one_gateway_is_a_semantic_hit_in_the_other(self):
        first = self.post(self.a, "Which planet is known as the red planet?")
        self.assertEqual(first.headers["x-tessera-cache"], "miss")
        import time
        deadline = time.time() + 10  # the store runs on a cache worker after the answer went out
        while time.time() < deadline:
            keys = self.redis.cli("--scan", "--pattern", "tessera:semantic:*").split()
            if len(keys) >= 2:
                break
            time.sleep(0.05)
        self.assertEqual(len(keys), 2, keys)  # the entry and its partition's index
        hit = self.post(self.b, "What planet is called the red planet?")
        self.assertTrue(hit.headers["x-tessera-cache"].startswith("hit; layer=semantic; tier=redis"),
                        hit.headers["x-tessera-cache"])
        self.assertEqual(hit.json()["choices"][0]["message"]["content"],
                         first.json()["choices"][0]["message"]["content"])
        again = self.post(self.b, "What planet is called the red planet?")
        self.assertTrue(again.headers["x-tessera-cache"].startswith("hit; layer=semantic; tier=memory"))

    def test_redis_down_then_back(self):
        def errors(server):
            for line in server.metrics().splitlines():
                if line.startswith('tessera_cache_redis_errors_total{layer="semantic"}'):
                    return float(line.rsplit(" ", 1)[1])
            return 0.0

        before = errors(self.a)
        self.redis.kill()
        try:
            for g in (self.a, self.b):  # both replicas keep serving (and notice the outage)
                r = self.post(g, "How far away is the Moon from the Earth?")
                self.assertEqual(r.headers["x-tessera-cache"], "miss")  # served by the model
            self.assertGreater(errors(self.a), before)
        finally:
            self.redis.start()  # same port, empty
        import time
        time.sleep(0.5)  # past redis_backoff_max
        self.post(self.a, "Who painted the Mona Lisa?")
        deadline = time.time() + 10
        while time.time() < deadline and not self.redis.cli("--scan", "--pattern", "tessera:semantic:*").split():
            time.sleep(0.05)
        hit = self.post(self.b, "Who was the painter of the Mona Lisa?")
        self.assertTrue(hit.headers["x-tessera-cache"].startswith("hit; layer=semantic; tier=redis"),
                        hit.headers["x-tessera-cache"])


if __name__ == "__main__":
    unittest.main(verbosity=2)
