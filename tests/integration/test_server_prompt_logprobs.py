"""Prompt log-probabilities on /v1/completions (issue 16 part 3): `echo` + `logprobs`, with
`max_tokens: 0` (lm-eval's loglikelihood request), in OpenAI's legacy completions shape.

- the server's numbers equal the offline ones (`tessera eval --prompt-logprobs`: one forward
  pass per prompt from an empty cache, no scheduler) within 1e-5, on a stack whose chunked
  prefill cuts the prompts into several chunks, with other requests decoding alongside;
- a prompt whose prefix is in the prefix cache still gets every logprob (the request bypasses
  the cache) and the cache keeps serving other requests;
- echo with generation: the prompt's entries, then the generated tokens' entries equal to the
  same request without echo; top_logprobs; batches and n > 1; errors name their field;
- on the exact stack (f32 KV cache, naive attention: configs/smollm2-cpu-f32kv.yaml) the
  logprob of each llama.cpp reference prompt's first greedy token equals llama.cpp's, from
  its committed logits (tests/fixtures/reference), within 1e-3.
"""
import json
import math
import os
import struct
import subprocess
import sys
import tempfile
import threading
import unittest

sys.path.insert(0, os.path.dirname(__file__))
import server_harness as h  # noqa: E402

h.require_environment(modules=("openai", "httpx"))
import httpx  # noqa: E402

SERVER = None
MODEL = None
FIXTURES = os.path.join(h.SOURCE_DIR, "tests", "fixtures", "reference")
EXACT_STACK = os.path.join(h.SOURCE_DIR, "configs", "smollm2-cpu-f32kv.yaml")

LONG = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
        "combined movable metal type, oil-based ink and a wooden press adapted from wine making. "
        "Within fifty years printing shops had opened in more than two hundred European cities, "
        "and the number of books grew from thousands to millions. Scholars could compare identical "
        "copies of a text for the first time, which changed how knowledge was checked and shared. "
        "Newspapers followed in the seventeenth century, pamphlets carried political arguments to "
        "readers who had never owned a book, and cheap almanacs told farmers when to plant.")
PROMPTS = [
    "The capital of France is Paris.",
    "def add(a, b):\n    return a + b\n",
    "Les élèves étudient à Genève. 東京は日本の首都です。🗼",
    "<|im_start|>user\nWhat is 12 + 30?<|im_end|>\n<|im_start|>assistant\n42",
    "1, 1, 2, 3, 5, 8, 13, 21, 34",
    LONG,
]


def setUpModule():
    global SERVER, MODEL
    # Chunks of at most 48 tokens: the long prompt spans several prefill steps.
    SERVER = h.Server(name="promptlp")
    with open(SERVER.config, "w") as f:
        f.write(f"extends: {h.DEFAULT_STACK}\n"
                "engine:\n  scheduler: {plugin: chunked-prefill, max_num_seqs: 32, max_batch_tokens: 48}\n"
                "server: {max_queued_requests: 64}\n")
    SERVER.start()
    MODEL = client().models.list().data[0].id


def tearDownModule():
    SERVER.stop_and_check()


def client():
    return SERVER.openai_client(api_key="none", timeout=300)


def post(path, body):
    return httpx.post(SERVER.url + path, json=body, timeout=300)


def offline(items, config=None):
    """`tessera eval --prompt-logprobs`: {id: (tokens, token_logprobs)}."""
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        for i, item in enumerate(items):
            f.write(json.dumps(dict(item, id=i)) + "\n")
    cmd = [h.TESSERA, "eval", "--quiet", "--prompt-logprobs", f.name]
    if config:
        cmd += ["-c", config]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    os.unlink(f.name)
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
    return {r["id"]: (r["tokens"], r["token_logprobs"]) for r in rows}


def tokenize(text):
    r = post("/tokenize", {"prompt": text})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


class PromptLogprobs(unittest.TestCase):
    def echo0(self, prompt, logprobs=1, **kw):
        return client().completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True,
                                           logprobs=logprobs, temperature=0, **kw)

    def assert_close(self, got, want, tol, what):
        self.assertEqual(len(got), len(want), what)
        self.assertIsNone(got[0], what)
        self.assertIsNone(want[0], what)
        worst = max(abs(a - b) for a, b in zip(got[1:], want[1:])) if len(got) > 1 else 0.0
        self.assertLess(worst, tol, f"{what}: max |server - offline| = {worst}")
        return worst

    def test_shape_of_max_tokens_0(self):
        prompt = PROMPTS[0]
        r = self.echo0(prompt)
        c = r.choices[0]
        ids = tokenize(prompt)
        self.assertEqual(c.text, prompt)
        self.assertEqual(c.finish_reason, "length")
        lp = c.logprobs
        self.assertEqual(len(lp.tokens), len(ids))
        self.assertEqual("".join(lp.tokens), prompt)  # byte-level BPE pieces concatenate to the text
        self.assertIsNone(lp.token_logprobs[0])
        self.assertIsNone(lp.top_logprobs[0])
        self.assertTrue(all(x <= 0 for x in lp.token_logprobs[1:]))
        self.assertEqual(lp.text_offset[0], 0)
        self.assertEqual(lp.text_offset, sorted(lp.text_offset))
        for tok, off in zip(lp.tokens, lp.text_offset):
            self.assertEqual(prompt[off:off + len(tok)], tok)
        self.assertEqual(r.usage.prompt_tokens, len(ids))
        self.assertEqual(r.usage.completion_tokens, 0)

    def test_server_equals_offline_with_chunked_prefill_under_load(self):
        # Other requests decode while the prompts are evaluated in 48-token chunks.
        stop = threading.Event()
        def background():
            while not stop.is_set():
                client().completions.create(model=MODEL, prompt="Once upon a time", max_tokens=24,
                                            extra_body={"ignore_eos": True})
        threads = [threading.Thread(target=background) for _ in range(2)]
        for t in threads:
            t.start()
        try:
            got = {}
            lock = threading.Lock()
            def one(i, p):
                r = self.echo0(p)
                with lock:
                    got[i] = r.choices[0].logprobs.token_logprobs
            workers = [threading.Thread(target=one, args=(i, p)) for i, p in enumerate(PROMPTS)]
            for w in workers:
                w.start()
            for w in workers:
                w.join()
        finally:
            stop.set()
            for t in threads:
                t.join()
        want = offline([{"prompt": p} for p in PROMPTS])
        self.assertGreater(len(want[len(PROMPTS) - 1][0]), 48 * 2)  # the long prompt spans 3+ chunks
        worst = 0.0
        for i, p in enumerate(PROMPTS):
            self.assertEqual(tokenize(p), want[i][0])
            worst = max(worst, self.assert_close(got[i], want[i][1], 1e-5, f"prompt {i}"))
        print(f"\nserver vs offline prompt logprobs: max |diff| = {worst:.3g} over {len(PROMPTS)} prompts")

    def test_a_cached_prefix_is_recomputed_for_prompt_logprobs(self):
        prompt = LONG + " The press also spread new ideas quickly."
        plain = client().completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
        again = client().completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
        self.assertGreater(again.usage.prompt_tokens_details.cached_tokens, 0)  # the cache works
        r = self.echo0(prompt)
        self.assertEqual(r.usage.prompt_tokens_details.cached_tokens, 0)
        want = offline([{"prompt": prompt}])[0]
        self.assert_close(r.choices[0].logprobs.token_logprobs, want[1], 1e-5, "after a cache hit")
        after = client().completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
        self.assertGreater(after.usage.prompt_tokens_details.cached_tokens, 0)
        self.assertEqual(after.choices[0].text, plain.choices[0].text)

    def test_echo_with_generation_appends_the_generated_tokens(self):
        prompt = "The three primary colours are"
        alone = client().completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logprobs=2,
                                            extra_body={"ignore_eos": True})
        r = client().completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logprobs=2,
                                        echo=True, extra_body={"ignore_eos": True})
        c = r.choices[0]
        n = len(tokenize(prompt))
        self.assertEqual(c.text, prompt + alone.choices[0].text)
        self.assertEqual(c.logprobs.tokens[n:], alone.choices[0].logprobs.tokens)
        for a, b in zip(c.logprobs.token_logprobs[n:], alone.choices[0].logprobs.token_logprobs):
            self.assertAlmostEqual(a, b, delta=1e-5)
        self.assertEqual(c.logprobs.text_offset[n:],
                         [len(prompt) + o for o in alone.choices[0].logprobs.text_offset])
        # The prompt's entries equal max_tokens 0's.
        zero = self.echo0(prompt, logprobs=2).choices[0].logprobs
        self.assertEqual(c.logprobs.token_logprobs[:n], zero.token_logprobs)
        self.assertEqual(c.logprobs.top_logprobs[:n], zero.top_logprobs)

    def test_top_logprobs_are_the_most_likely_alternatives(self):
        prompt = "One, two, three, four, five"
        lp = self.echo0(prompt, logprobs=5).choices[0].logprobs
        for i in range(1, len(lp.tokens)):
            top = lp.top_logprobs[i]
            self.assertGreaterEqual(len(top), 4)  # 5 ids; two may share a piece
            self.assertLessEqual(len(top), 5)
            self.assertLessEqual(lp.token_logprobs[i], max(top.values()) + 1e-6)
            self.assertLessEqual(sum(math.exp(v) for v in top.values()), 1.0 + 1e-4)
            if lp.tokens[i] in top:
                self.assertAlmostEqual(top[lp.tokens[i]], lp.token_logprobs[i], delta=1e-6)
        # Counting is greedy here: the model has seen this sequence.
        self.assertEqual(max(lp.top_logprobs[-1], key=lp.top_logprobs[-1].get), lp.tokens[-1])

    def test_batches_and_n(self):
        batch = self.echo0(PROMPTS[:3])
        self.assertEqual([c.index for c in batch.choices], [0, 1, 2])
        for i, c in enumerate(batch.choices):
            alone = self.echo0(PROMPTS[i]).choices[0]
            self.assertEqual(c.text, PROMPTS[i])
            self.assertEqual(c.logprobs.token_logprobs, alone.logprobs.token_logprobs)
        ids = tokenize(PROMPTS[1])
        two = self.echo0(ids, n=2)  # a token-id prompt, two samples
        self.assertEqual(len(two.choices), 2)
        self.assertEqual(two.choices[0].logprobs.token_logprobs, two.choices[1].logprobs.token_logprobs)
        self.assertEqual(two.choices[0].text, PROMPTS[1])

    def test_echo_without_logprobs_and_streamed_echo(self):
        r = client().completions.create(model=MODEL, prompt="Hello", max_tokens=0, echo=True)
        self.assertEqual(r.choices[0].text, "Hello")
        self.assertIsNone(r.choices[0].logprobs)
        chunks = list(client().completions.create(model=MODEL, prompt="Hello", max_tokens=3, echo=True,
                                                  temperature=0, stream=True))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        plain = client().completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0)
        self.assertEqual(text, "Hello" + plain.choices[0].text)

    def test_streamed_echo_with_logprobs_equals_the_whole_response(self):
        # The stream opens each choice with the prompt and its logprobs (once computed), then
        # the generated tokens with offsets into the echoed text: together, the whole response.
        for body in [{"prompt": PROMPTS[2], "max_tokens": 0, "logprobs": 2},
                     {"prompt": PROMPTS[1], "max_tokens": 6, "logprobs": 3, "temperature": 0},
                     {"prompt": [PROMPTS[0], PROMPTS[3]], "max_tokens": 4, "logprobs": 1, "temperature": 0.8,
                      "seed": 11, "n": 2}]:
            whole = client().completions.create(model=MODEL, echo=True, **body)
            chunks = list(client().completions.create(model=MODEL, echo=True, stream=True, **body))
            for c in whole.choices:
                mine = [ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].index == c.index]
                self.assertEqual("".join(m.text for m in mine), c.text, body)
                self.assertEqual(mine[-1].finish_reason, c.finish_reason)
                lps = [m.logprobs for m in mine if m.logprobs is not None]
                self.assertEqual(sum((lp.tokens for lp in lps), []), c.logprobs.tokens)
                self.assertEqual(sum((lp.text_offset for lp in lps), []), c.logprobs.text_offset)
                got = sum((lp.token_logprobs for lp in lps), [])
                self.assertEqual([g is None for g in got], [w is None for w in c.logprobs.token_logprobs])
                for g, w in zip(got, c.logprobs.token_logprobs):
                    if w is not None:
                        self.assertAlmostEqual(g, w, places=4)
        self.assertTrue(SERVER.wait_for_metric("tessera_kv_blocks_used", 0.0), SERVER.metrics())

    def test_errors_name_the_field(self):
        for body, param in [
            ({"prompt": "Hi", "max_tokens": 0}, "max_tokens"),
            ({"prompt": "Hi", "max_tokens": 0, "echo": "yes"}, "echo"),
            ({"prompt": "Hi", "max_tokens": 0, "echo": True, "logprobs": 21}, "logprobs"),
            ({"prompt": "Hi", "max_tokens": -1, "echo": True}, "max_tokens"),
        ]:
            r = post("/v1/completions", dict(body, model=MODEL))
            self.assertEqual(r.status_code, 400, (body, r.text))
            err = r.json()["error"]
            self.assertEqual(err["param"], param, err)
            self.assertTrue(err["message"].startswith(param), err)
        # Chat has no max_tokens 0.
        r = post("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                                          "max_tokens": 0})
        self.assertEqual(r.status_code, 400)
        self.assertEqual(r.json()["error"]["param"], "max_tokens")
        # Nothing leaked: every KV block is free once the engine is idle.
        self.assertTrue(SERVER.wait_for_metric("tessera_kv_blocks_used", 0.0), SERVER.metrics())


class LlamaCppReference(unittest.TestCase):
    def test_exact_stack_equals_llama_cpp_within_1e_3(self):
        meta = json.load(open(os.path.join(FIXTURES, "smollm2-135m-instruct-q4_1.json")))
        vocab = meta["vocab_size"]
        raw = open(os.path.join(FIXTURES, meta["logits_file"]), "rb").read()
        items, want = [], []
        for k, p in enumerate(meta["prompts"]):
            row = struct.unpack_from(f"<{vocab}f", raw, 4 * vocab * k)
            mx = max(row)
            log_norm = mx + math.log(sum(math.exp(x - mx) for x in row))
            first = p["greedy_ids"][0]
            # The prompt plus llama.cpp's first greedy token: its logprob is the last entry.
            items.append({"tokens": p["prompt_ids"] + [first]})
            want.append(row[first] - log_norm)
        got = offline(items, config=EXACT_STACK)
        worst = 0.0
        for k, w in enumerate(want):
            g = got[k][1][-1]
            worst = max(worst, abs(g - w))
            self.assertLess(abs(g - w), 1e-3, meta["prompts"][k]["name"])
        print(f"\nexact stack vs llama.cpp ({meta['reference']}): max |logprob diff| = {worst:.3g} "
              f"over {len(want)} prompts (first greedy token)")

    def test_every_prompt_position_and_loglikelihood_equals_llama_cpp_within_1e_3(self):
        # llama.cpp's log-probability of every next token of lm-eval's multiple-choice
        # requests (and a 457-token text), from scripts/make-prompt-logprob-fixture.py, against
        # Tessera's exact stack fed the same token ids (`tessera eval --prompt-logprobs`, which
        # test_server_equals_offline_with_chunked_prefill_under_load ties to the server).
        meta = json.load(open(os.path.join(FIXTURES, "smollm2-135m-instruct-q4_1.prompt-logprobs.json")))
        reqs = meta["requests"]
        got = offline([{"tokens": r["tokens"]} for r in reqs], config=EXACT_STACK)
        worst = worst_sum = 0.0
        positions = 0
        for k, r in enumerate(reqs):
            tokens, logprobs = got[k]
            self.assertEqual(len(logprobs), len(r["tokens"]), r["name"])
            self.assertIsNone(logprobs[0])
            for i, want in enumerate(r["token_logprobs"]):
                worst = max(worst, abs(logprobs[i + 1] - want))
                positions += 1
                self.assertLess(abs(logprobs[i + 1] - want), 1e-3, f"{r['name']} position {i + 1}")
            worst_sum = max(worst_sum, abs(sum(logprobs[1:]) - sum(r["token_logprobs"])))
        self.assertLess(worst_sum, 1e-3)
        print(f"\nexact stack vs llama.cpp ({meta['reference']}), {len(reqs)} requests, {positions} positions: "
              f"max |logprob diff| {worst:.3g}, max |loglikelihood diff| {worst_sum:.3g}")


if __name__ == "__main__":
    sys.exit(h.run_tests([PromptLogprobs, LlamaCppReference]))
