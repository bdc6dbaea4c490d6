"""The gateway (issue 15) end to end, on the real model and a real redis-server:

- two deployments of the default model with different stacks (chunked prefill, continuous
  batching) and an ab-split router, behind the official `openai` client: the model list,
  streaming, errors naming the model or the field, a cache hit returning the original text
  (streamed or not) and saying so;
- the exact cache's Redis tier shared by two gateway processes: stored through one, a hit in
  the other; Redis's own TTL (PX) set and honoured; Redis killed mid-run -> requests still
  served by the model, the error counter rises, sharing resumes after a restart;
- the in-process tier alone: TTL expiry, eviction under a byte budget;
- ab-split: sticky per user, weights within a stated statistical tolerance, per-arm metrics.

redis-server comes from Debian's `redis-server` package (scripts/install-deps.sh) and is
started by the test on a free loopback port with persistence off.
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import unittest
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(__file__))
import server_harness as h  # noqa: E402

h.require_environment(modules=("openai", "httpx"))
if not shutil.which("redis-server") or not shutil.which("redis-cli"):
    h.skip_or_fail("redis-server / redis-cli are missing (run scripts/install-deps.sh)")
import httpx  # noqa: E402
import openai  # noqa: E402

TTL_SECONDS = 6
A_WEIGHT, B_WEIGHT = 30, 70  # arms of the ab router: continuous 30 %, chunked 70 %


def small_stack(extra=""):
    # The default stack with a small KV pool, so two engines per process and two processes fit.
    return (f"{{extends: {h.DEFAULT_STACK}, engine: {{kv_cache: {{plugin: paged, memory: 64MiB}}{extra}}}}}")


def two_deployment_yaml(redis_port):
    return f"""deployments:
  chunked: {small_stack()}
  continuous: {small_stack(", scheduler: {plugin: continuous, max_num_seqs: 32}")}
gateway:
  cache:
    - {{plugin: exact, ttl: {TTL_SECONDS}s, max_bytes: 8MiB, redis_url: "redis://127.0.0.1:{redis_port}",
       redis_timeout: 200ms, redis_backoff_max: 300ms}}
  router: {{plugin: ab-split, name: ab, arms: {{continuous: {A_WEIGHT}, chunked: {B_WEIGHT}}}}}
server: {{max_queued_requests: 256}}
"""


REDIS = A = B = None


def setUpModule():
    global REDIS, A, B
    REDIS = h.Redis().start()
    yaml = two_deployment_yaml(REDIS.port)
    try:
        A = h.Gateway(yaml, "gateway-a").start(timeout=240)
        B = h.Gateway(yaml, "gateway-b").start(timeout=240)
    except Exception:
        # unittest skips tearDownModule when setUpModule fails: leave no process behind.
        if A:
            A.stop()
        REDIS.kill()
        raise


def tearDownModule():
    for g in (A, B):
        if g:
            rc = g.stop()
            assert rc == 0, f"gateway exit status {rc}:\n" + "".join(g.stderr_lines[-30:])
    if REDIS and REDIS.proc.poll() is None:
        REDIS.kill()


def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def complete(server, prompt, model="chunked", max_tokens=8, **extra):
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r


def metric_value(server, name, labels):
    """The value of `name{labels...}` (labels a dict, matched as a subset), or 0."""
    total = None
    for line in server.metrics().splitlines():
        if not line.startswith(name + "{"):
            continue
        head, value = line.rsplit(" ", 1)
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total = (total or 0) + float(value)
    return total or 0.0


_serial = [0]


def unique(prefix):
    _serial[0] += 1
    return f"{prefix} {_serial[0]} {time.time_ns()}:"


class OpenAiClient(unittest.TestCase):
    def test_model_list_names_every_deployment_and_the_router(self):
        ids = [m.id for m in client(A).models.list().data]
        self.assertEqual(ids, ["chunked", "continuous", "ab"])
        self.assertEqual(client(A).models.retrieve("continuous").id, "continuous")

    def test_unknown_model_is_a_404_naming_it_and_what_is_served(self):
        with self.assertRaises(openai.NotFoundError) as ctx:
            client(A).chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "hi"}])
        message = str(ctx.exception)
        self.assertIn("gpt-9", message)
        self.assertIn("'chunked'", message)
        self.assertIn("'ab' (a router)", message)

    def test_a_bad_field_is_a_400_naming_it_and_the_server_goes_on(self):
        with self.assertRaises(openai.BadRequestError) as ctx:
            client(A).chat.completions.create(model="continuous", messages=[{"role": "user", "content": "hi"}],
                                              temperature="hot")
        self.assertIn("temperature", str(ctx.exception))
        with self.assertRaises(openai.BadRequestError) as ctx:
            client(A).completions.create(model="ab", prompt="x", max_tokens=100000)
        self.assertIn("max_tokens", str(ctx.exception))
        self.assertEqual(complete(A, unique("still up")).json()["object"], "text_completion")

    def test_each_deployment_streams_and_both_stacks_agree_greedily(self):
        texts = {}
        content = unique("Name a colour.")  # one prompt for both deployments
        for model in ("chunked", "continuous"):
            stream = client(A).chat.completions.create(
                model=model, messages=[{"role": "user", "content": content}],
                max_tokens=12, temperature=0, stream=True)
            chunks = list(stream)
            self.assertTrue(all(c.model == model for c in chunks))
            texts[model] = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            self.assertTrue(texts[model])
        # Different schedulers, same greedy tokens (the engine's invariance, through the gateway).
        self.assertEqual(texts["chunked"], texts["continuous"])

    def test_a_cache_hit_returns_the_original_text_and_says_it_was_cached(self):
        messages = [{"role": "user", "content": unique("Say something about the sea")}]
        c = client(A)
        before = set(REDIS.keys())
        first = c.chat.completions.with_raw_response.create(model="continuous", messages=messages, max_tokens=16,
                                                            temperature=0)
        self.assertEqual(first.headers["x-tessera-cache"], "miss")
        original = first.parse().choices[0].message.content
        self.assertTrue(REDIS.wait_for_new_key(before))  # stored (the in-process tier first)
        second = c.chat.completions.with_raw_response.create(model="continuous", messages=messages, max_tokens=16,
                                                             temperature=0)
        self.assertEqual(second.headers["x-tessera-cache"], "hit; layer=exact; tier=memory; similarity=1.0000")
        parsed = second.parse()
        self.assertEqual(parsed.choices[0].message.content, original)
        self.assertEqual(parsed.choices[0].finish_reason, first.parse().choices[0].finish_reason)
        self.assertEqual(parsed.model_extra["tessera_cache"], {"hit": True, "layer": "exact", "tier": "memory", "similarity": 1.0})
        self.assertEqual(parsed.usage.completion_tokens, first.parse().usage.completion_tokens)
        # Streamed, the hit arrives as SSE chunks that join to the same text.
        with c.chat.completions.with_streaming_response.create(model="continuous", messages=messages, max_tokens=16,
                                                               temperature=0, stream=True) as resp:
            self.assertEqual(resp.headers["x-tessera-cache"], "hit; layer=exact; tier=memory; similarity=1.0000")
            chunks = list(resp.parse())
        self.assertGreater(len(chunks), 2)
        self.assertEqual("".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices), original)
        # The other deployment has its own key: the same request there is a miss.
        other = c.chat.completions.with_raw_response.create(model="chunked", messages=messages, max_tokens=16,
                                                            temperature=0)
        self.assertEqual(other.headers["x-tessera-cache"], "miss")

    def test_a_response_ended_by_a_stop_string_is_cached_and_replayed_identically(self):
        prompt = unique("Count: one, two, three, four, five, six")
        # A stop string the greedy answer is known to contain: 4 characters from its middle.
        text = complete(A, prompt, model="chunked", max_tokens=24).json()["choices"][0]["text"]
        self.assertGreaterEqual(len(text), 8, text)
        stop = text[len(text) // 2:len(text) // 2 + 4]
        before = set(REDIS.keys())
        first = complete(A, prompt, model="chunked", max_tokens=24, stop=[stop]).json()
        self.assertEqual(first["choices"][0]["finish_reason"], "stop")
        self.assertEqual(first["choices"][0]["text"].find(stop), -1)
        self.assertTrue(REDIS.wait_for_new_key(before))
        hit = complete(A, prompt, model="chunked", max_tokens=24, stop=[stop])
        self.assertTrue(hit.headers["x-tessera-cache"].startswith("hit"), hit.headers.get("x-tessera-cache"))
        self.assertEqual(hit.json()["choices"][0]["text"], first["choices"][0]["text"])
        self.assertEqual(hit.json()["choices"][0]["finish_reason"], "stop")

    def test_sampled_requests_without_a_seed_are_not_cached(self):
        prompt = unique("Tell me a word")
        r1 = complete(A, prompt, temperature=1.0)
        self.assertEqual(r1.headers["x-tessera-cache"], "miss")
        r2 = complete(A, prompt, temperature=1.0)
        self.assertEqual(r2.headers["x-tessera-cache"], "miss")
        self.assertGreaterEqual(metric_value(A, "tessera_cache_layer_skipped_total", {"layer": "exact"}), 2)
        # With a seed the output is reproducible, so it is cached.
        before = set(REDIS.keys())
        s1 = complete(A, prompt, temperature=1.0, seed=42)
        self.assertTrue(REDIS.wait_for_new_key(before))
        s2 = complete(A, prompt, temperature=1.0, seed=42)
        self.assertEqual(s2.headers["x-tessera-cache"], "hit; layer=exact; tier=memory; similarity=1.0000")
        self.assertEqual(s1.json()["choices"][0]["text"], s2.json()["choices"][0]["text"])


class SharedTier(unittest.TestCase):
    def test_stored_through_one_gateway_is_a_hit_in_the_other_and_ttl_is_honoured(self):
        prompt = unique("The history of bridges")
        before = set(REDIS.keys())
        original = complete(A, prompt)
        self.assertEqual(original.headers["x-tessera-cache"], "miss")
        self.assertTrue(REDIS.wait_for_new_key(before))
        hit = complete(B, prompt)
        self.assertEqual(hit.headers["x-tessera-cache"], "hit; layer=exact; tier=redis; similarity=1.0000")
        self.assertEqual(hit.json()["choices"][0]["text"], original.json()["choices"][0]["text"])
        # Redis holds the TTL itself.
        for key in REDIS.keys():
            pttl = int(REDIS.cli("PTTL", key))
            self.assertTrue(0 < pttl <= TTL_SECONDS * 1000, pttl)
        # After the TTL: gone from Redis, and a miss in both processes (B's copy keeps the
        # original expiry).
        time.sleep(TTL_SECONDS + 0.5)
        self.assertEqual(REDIS.keys(), [])
        self.assertEqual(complete(B, prompt).headers["x-tessera-cache"], "miss")

    def test_redis_down_then_back(self):
        errors_before = metric_value(A, "tessera_cache_redis_errors_total", {"layer": "exact"})
        REDIS.kill()
        try:
            for i in range(3):
                r = complete(A, unique("while redis is down"))
                self.assertEqual(r.json()["choices"][0]["finish_reason"] in ("stop", "length"), True)
            self.assertGreater(metric_value(A, "tessera_cache_redis_errors_total", {"layer": "exact"}), errors_before)
            self.assertEqual(metric_value(A, "tessera_cache_redis_up", {"layer": "exact"}), 0)
        finally:
            REDIS.start()  # same port, empty
        time.sleep(0.5)  # longer than redis_backoff_max
        prompt = unique("after redis came back")
        original = complete(A, prompt)
        self.assertTrue(REDIS.wait_for_keys(1), "A did not store into the restarted Redis")
        hit = complete(B, prompt)
        self.assertEqual(hit.headers["x-tessera-cache"], "hit; layer=exact; tier=redis; similarity=1.0000")
        self.assertEqual(hit.json()["choices"][0]["text"], original.json()["choices"][0]["text"])
        self.assertEqual(metric_value(A, "tessera_cache_redis_up", {"layer": "exact"}), 1)


class AbSplit(unittest.TestCase):
    def test_sticky_per_user_and_per_api_key(self):
        for user in ("alice", "bob", "carol"):
            arms = set()
            for i in range(6):
                r = complete(A, unique(f"sticky {user}"), model="ab", max_tokens=1, user=user)
                arms.add(r.headers["x-tessera-route"])
                self.assertEqual(r.json()["model"], r.headers["x-tessera-route"].split("=")[1])
            self.assertEqual(len(arms), 1, f"{user} saw {arms}")
        # Without `user`, the API key keeps the arm.
        arms = set()
        for i in range(6):
            r = httpx.post(A.url + "/v1/completions", headers={"Authorization": "Bearer key-of-dave"}, timeout=120,
                           json={"model": "ab", "prompt": unique("key"), "max_tokens": 1, "temperature": 0})
            arms.add(r.headers["x-tessera-route"])
        self.assertEqual(len(arms), 1, arms)

    def test_weights_within_tolerance_and_per_arm_metrics(self):
        before = {arm: metric_value(A, "tessera_router_requests_total", {"router": "ab", "arm": arm})
                  for arm in ("continuous", "chunked")}
        n = 300
        def one(i):
            r = complete(A, f"weights {i} {time.time_ns()}:", model="ab", max_tokens=2, user=f"user-{i}")
            return r.json()["model"]
        with ThreadPoolExecutor(8) as pool:
            arms = list(pool.map(one, range(n)))
        share = arms.count("continuous") / n
        expected = A_WEIGHT / (A_WEIGHT + B_WEIGHT)
        # 4 standard deviations of a binomial share: sqrt(0.3 * 0.7 / 300) = 0.026 -> +-0.106.
        tolerance = 4 * (expected * (1 - expected) / n) ** 0.5
        print(f"ab-split: {arms.count('continuous')}/{n} to continuous = {share:.3f} "
              f"(expected {expected:.2f} +- {tolerance:.3f})")
        self.assertLess(abs(share - expected), tolerance)
        for arm in ("continuous", "chunked"):
            routed = metric_value(A, "tessera_router_requests_total", {"router": "ab", "arm": arm}) - before[arm]
            self.assertEqual(routed, arms.count(arm))
            self.assertGreater(metric_value(A, "tessera_router_time_to_first_token_seconds_count",
                                            {"router": "ab", "arm": arm}), 0)
            self.assertGreater(metric_value(A, "tessera_router_time_per_output_token_seconds_count",
                                            {"router": "ab", "arm": arm}), 0)
            self.assertGreater(metric_value(A, "tessera_deployment_time_to_first_token_seconds_count",
                                            {"deployment": arm}), 0)
            self.assertGreater(metric_value(A, "tessera_deployment_queue_time_seconds_count",
                                            {"deployment": arm}), 0)
            self.assertGreater(metric_value(A, "tessera_deployment_engine_steps_total", {"deployment": arm}), 0)
        # Every deployment's engine gave all KV blocks back once the requests were answered.
        deadline = time.time() + 20
        while time.time() < deadline and any(
                metric_value(A, "tessera_deployment_kv_blocks_used", {"deployment": d}) for d in ("chunked", "continuous")):
            time.sleep(0.1)
        for d in ("chunked", "continuous"):
            self.assertEqual(metric_value(A, "tessera_deployment_kv_blocks_used", {"deployment": d}), 0)
            self.assertGreater(metric_value(A, "tessera_deployment_kv_blocks_total", {"deployment": d}), 0)


class ExampleConfig(unittest.TestCase):
    def test_the_shipped_gateway_config_validates(self):
        out = subprocess.run([h.TESSERA, "config", "check", os.path.join(h.SOURCE_DIR, "configs", "gateway-ab.yaml")],
                             capture_output=True, text=True, timeout=60)
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn("deployments.chunked.engine.scheduler:", out.stdout)
        self.assertIn("deployments.continuous.engine.scheduler:", out.stdout)
        self.assertIn("continuous", out.stdout.split("deployments.continuous.engine.scheduler:")[1].splitlines()[0])
        self.assertIn("gateway.router (model 'ab')", out.stdout)


class MemoryTier(unittest.TestCase):
    """A one-deployment gateway with the in-process tier only: TTL and the byte budget."""

    def test_ttl_expiry_and_eviction_under_a_byte_budget(self):
        yaml = f"""extends: {h.DEFAULT_STACK}
engine: {{kv_cache: {{plugin: paged, memory: 64MiB}}}}
gateway:
  cache: [{{plugin: exact, ttl: 2s, max_bytes: 2KiB}}]
"""
        g = h.Gateway(yaml, "gateway-memory")
        try:
            g.start(timeout=240)
            model = client(g).models.list().data[0].id
            prompt = unique("ttl")
            self.assertEqual(complete(g, prompt, model=model).headers["x-tessera-cache"], "miss")
            self.assertEqual(complete(g, prompt, model=model).headers["x-tessera-cache"],
                             "hit; layer=exact; tier=memory; similarity=1.0000")
            time.sleep(2.3)
            self.assertEqual(complete(g, prompt, model=model).headers["x-tessera-cache"], "miss")
            self.assertGreaterEqual(metric_value(g, "tessera_cache_layer_expired_total", {"layer": "exact"}), 1)

            prompts = [unique(f"evict {i}") for i in range(12)]
            for p in prompts:
                complete(g, p, model=model, max_tokens=16)
            time.sleep(0.3)  # stores run on the cache workers
            budget = metric_value(g, "tessera_cache_layer_memory_budget_bytes", {"layer": "exact"})
            used = metric_value(g, "tessera_cache_layer_memory_bytes", {"layer": "exact"})
            self.assertEqual(budget, 2048)
            self.assertLessEqual(used, budget)
            self.assertGreater(metric_value(g, "tessera_cache_layer_evictions_total", {"layer": "exact"}), 0)
            # Least recently used first out: the newest answer is still there, the oldest is not.
            self.assertTrue(complete(g, prompts[-1], model=model, max_tokens=16).headers["x-tessera-cache"]
                            .startswith("hit"))
            self.assertEqual(complete(g, prompts[0], model=model, max_tokens=16).headers["x-tessera-cache"], "miss")
            # Every sequence gave its KV blocks back.
            self.assertTrue(g.wait_for_metric("tessera_kv_blocks_used", 0))
        finally:
            self.assertEqual(g.stop(), 0)


if __name__ == "__main__":
    sys.exit(h.run_tests([OpenAiClient, SharedTier, AbSplit, ExampleConfig, MemoryTier]))
