"""OpenAI/vLLM API parity of `tessera serve` (issue 16), with the official `openai` client
where a client call exists and httpx otherwise:

- batched prompts on /v1/completions (strings and token-id lists; `n` for each; choice index
  = prompt index * n + sample index; streamed too), each choice equal to the same prompt
  sent alone;
- vLLM's /tokenize and /detokenize (prompt and chat forms), consistent with usage;
- special-token text in a completions prompt recognized as the chat template path does and
  as llama.cpp does (the reference fixture's prompt ids); `parse_special: false` keeps it text;
- usage.prompt_tokens_details.cached_tokens from the prefix cache, equal to the server's
  prefix-cache hit counter;
- /metrics parsed by prometheus_client: every family once, with its declared type;
- one access-log line per request, without the prompt or the key.
"""
import json
import os
import re
import sys
import unittest

sys.path.insert(0, os.path.dirname(__file__))
import server_harness as h  # noqa: E402

h.require_environment(modules=("openai", "httpx", "prometheus_client"))
import httpx  # noqa: E402
import openai  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

KEY = "parity-key-93c1"
SERVER = None
MODEL = None
AUTH = {"Authorization": f"Bearer {KEY}"}


def setUpModule():
    global SERVER, MODEL
    SERVER = h.Server("max_queued_requests: 64", env={"TESSERA_API_KEYS": KEY}, name="parity").start()
    MODEL = client().models.list().data[0].id


def tearDownModule():
    rc = SERVER.stop()
    assert rc == 0, f"server exit status {rc}:\n" + "".join(SERVER.stderr_lines[-20:])


def client():
    return openai.OpenAI(base_url=SERVER.url + "/v1", api_key=KEY, max_retries=0, timeout=h.request_timeout(120))


def post(path, body):
    return httpx.post(SERVER.url + path, json=body, headers=AUTH, timeout=h.request_timeout(120))


def tokenize(**body):
    r = post("/tokenize", body)
    assert r.status_code == 200, r.text
    return r.json()


PROMPTS = ["The capital of France is", "Water boils at", "My favourite colour is"]


class BatchedPrompts(unittest.TestCase):
    def single(self, prompt, **kw):
        return client().completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, **kw)

    def test_a_list_of_strings_gives_n_choices_per_prompt_in_openai_order(self):
        eos = {"ignore_eos": True}
        alone = [self.single(p, extra_body=eos).choices[0].text for p in PROMPTS]
        r = client().completions.create(model=MODEL, prompt=PROMPTS, max_tokens=6, temperature=0, n=2,
                                        extra_body=eos)
        self.assertEqual(len(r.choices), len(PROMPTS) * 2)
        self.assertEqual([c.index for c in r.choices], list(range(6)))
        for c in r.choices:
            self.assertEqual(c.text, alone[c.index // 2], c.index)
            self.assertEqual(c.finish_reason, "length")
        prompt_tokens = sum(len(tokenize(prompt=p)["tokens"]) for p in PROMPTS)
        self.assertEqual(r.usage.prompt_tokens, prompt_tokens)
        self.assertEqual(r.usage.completion_tokens, 6 * 6)

    def test_a_list_of_token_id_lists(self):
        ids = [tokenize(prompt=p)["tokens"] for p in PROMPTS[:2]]
        r = client().completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
        self.assertEqual([c.index for c in r.choices], [0, 1])
        for c, p in zip(r.choices, PROMPTS[:2]):
            self.assertEqual(c.text, self.single(p).choices[0].text)
        self.assertEqual(r.usage.prompt_tokens, len(ids[0]) + len(ids[1]))

    def test_streamed_batch_equals_the_whole_one(self):
        whole = client().completions.create(model=MODEL, prompt=PROMPTS, max_tokens=6, temperature=0, n=2)
        texts = {}
        finish = {}
        usage = None
        for chunk in client().completions.create(model=MODEL, prompt=PROMPTS, max_tokens=6, temperature=0, n=2,
                                                 stream=True, stream_options={"include_usage": True}):
            if chunk.usage:
                usage = chunk.usage
            for c in chunk.choices:
                texts[c.index] = texts.get(c.index, "") + c.text
                if c.finish_reason:
                    finish[c.index] = c.finish_reason
        self.assertEqual(texts, {c.index: c.text for c in whole.choices})
        self.assertEqual(set(finish), set(range(6)))
        self.assertEqual(usage.prompt_tokens, whole.usage.prompt_tokens)
        self.assertEqual(usage.completion_tokens, whole.usage.completion_tokens)

    def test_a_client_leaving_a_streamed_batch_cancels_every_prompt(self):
        before = SERVER.metric("tessera_requests_cancelled_by_client_total")
        body = {"model": MODEL, "prompt": PROMPTS, "n": 2, "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", SERVER.url + "/v1/completions", json=body, headers=AUTH, timeout=h.request_timeout(120)) as r:
            self.assertEqual(r.status_code, 200)
            events = 0
            for line in r.iter_lines():
                events += line.startswith("data: ")
                if events >= 12:
                    break
        self.assertTrue(SERVER.wait_for_metric("tessera_requests_cancelled_by_client_total", before + 1))
        self.assertTrue(SERVER.wait_for_metric("tessera_requests_in_flight", 0))
        self.assertTrue(SERVER.wait_for_metric("tessera_kv_blocks_used", 0))
        self.assertTrue(SERVER.wait_for_metric("tessera_engine_running_sequences", 0))

    def test_a_prompt_ended_by_a_stop_string_stops_generating_while_the_batch_goes_on(self):
        eos = {"ignore_eos": True}
        first = self.single(PROMPTS[0], extra_body=eos).choices[0].text
        second = client().completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=200, temperature=0,
                                             extra_body=eos).choices[0].text
        stop = next((first[:k] for k in range(3, len(first) + 1) if first[:k].strip() and first[:k] not in second),
                    None)
        self.assertIsNotNone(stop, (first, second))
        before = SERVER.metric("tessera_generation_tokens_total")
        r = client().completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=200, temperature=0, stop=[stop],
                                        extra_body=eos)
        self.assertEqual(r.choices[0].finish_reason, "stop")
        self.assertEqual(r.choices[1].finish_reason, "length")
        self.assertEqual(r.choices[1].text, second)
        # Every sequence's last event counted (the stopped one's comes after its cancel).
        self.assertTrue(SERVER.wait_for_metric("tessera_requests_in_flight", 0))
        generated = SERVER.metric("tessera_generation_tokens_total") - before
        # Without the per-prompt cancel the engine would generate 200 tokens for each prompt.
        self.assertLess(generated, 300, "the stopped prompt went on generating")

    def test_batch_errors_name_the_prompt(self):
        with self.assertRaises(openai.BadRequestError) as e:
            client().completions.create(model=MODEL, prompt=["fine", ""], max_tokens=2)
        self.assertEqual(e.exception.body["param"], "prompt[1]")
        with self.assertRaises(openai.BadRequestError) as e:
            client().completions.create(model=MODEL, prompt=["fine", 7], max_tokens=2)
        self.assertEqual(e.exception.body["param"], "prompt[1]")
        long_prompt = " ".join(["word"] * 5000)
        with self.assertRaises(openai.BadRequestError) as e:
            client().completions.create(model=MODEL, prompt=["fine", long_prompt], max_tokens=2)
        self.assertEqual(e.exception.body["param"], "prompt[1]")
        self.assertIn("context", e.exception.body["message"])
        with self.assertRaises(openai.BadRequestError) as e:
            client().completions.create(model=MODEL, prompt=["x"] * 65, max_tokens=1)
        self.assertIn("max_queued_requests", e.exception.body["message"])
        # Nothing is left running after the refused batches.
        self.assertTrue(SERVER.wait_for_metric("tessera_requests_in_flight", 0))
        self.assertTrue(SERVER.wait_for_metric("tessera_kv_blocks_used", 0))


class Tokenizer(unittest.TestCase):
    def test_tokenize_shape_and_usage_agree(self):
        t = tokenize(model=MODEL, prompt="Hello world, hello tokens", return_token_strs=True)
        self.assertEqual(set(t), {"count", "max_model_len", "tokens", "token_strs"})
        self.assertEqual(t["count"], len(t["tokens"]))
        self.assertEqual(t["max_model_len"], client().models.list().data[0].model_extra["max_model_len"])
        self.assertEqual("".join(t["token_strs"]), "Hello world, hello tokens")
        r = client().completions.create(model=MODEL, prompt="Hello world, hello tokens", max_tokens=1)
        self.assertEqual(r.usage.prompt_tokens, t["count"])
        self.assertIsNone(tokenize(prompt="x")["token_strs"])

    def test_detokenize_round_trips(self):
        text = "Tokenizers round-trip: ünïcödé, emoji \U0001f600, tabs\tand\nnewlines."
        ids = tokenize(prompt=text)["tokens"]
        r = post("/detokenize", {"model": MODEL, "tokens": ids})
        self.assertEqual(r.status_code, 200, r.text)
        self.assertEqual(r.json(), {"prompt": text})
        self.assertEqual(post("/detokenize", {"tokens": []}).json(), {"prompt": ""})

    def test_chat_form_counts_what_chat_completions_feeds_the_model(self):
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
        t = tokenize(model=MODEL, messages=messages)
        r = client().chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
        self.assertEqual(r.usage.prompt_tokens, t["count"])
        without = tokenize(messages=messages, add_generation_prompt=False)
        self.assertLess(without["count"], t["count"])
        self.assertEqual(t["tokens"][:without["count"]], without["tokens"])

    def test_errors_name_the_field(self):
        cases = [({"prompt": 3}, "prompt"), ({}, "prompt"), ({"prompt": "x", "add_special_tokens": "yes"},
                                                            "add_special_tokens"),
                 ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
                 ({"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, "prompt")]
        for body, param in cases:
            r = post("/tokenize", body)
            self.assertEqual(r.status_code, 400, (body, r.text))
            self.assertEqual(r.json()["error"]["param"], param, body)
        vocab_error = post("/detokenize", {"tokens": [1, 2, 10 ** 9]})
        self.assertEqual(vocab_error.status_code, 400)
        self.assertEqual(vocab_error.json()["error"]["param"], "tokens[2]")
        for body in ({"tokens": "1 2"}, {"tokens": [1, -1]}, {"tokens": [1.5]}, {}):
            self.assertEqual(post("/detokenize", body).status_code, 400, body)
        self.assertEqual(post("/tokenize", {"model": "other", "prompt": "x"}).status_code, 404)
        self.assertEqual(httpx.post(SERVER.url + "/tokenize", json={"prompt": "x"}).status_code, 401,
                         "the tokenizer routes need the key like /v1/*")
        self.assertEqual(httpx.get(SERVER.url + "/tokenize", headers=AUTH).status_code, 405)


class SpecialTokens(unittest.TestCase):
    MESSAGES = [{"role": "system", "content": "You answer in one word."},
                {"role": "user", "content": "What colour is the sky?"}]

    def test_special_token_text_in_a_prompt_gets_the_chat_template_ids(self):
        chat_ids = tokenize(messages=self.MESSAGES)["tokens"]
        text = post("/detokenize", {"tokens": chat_ids}).json()["prompt"]
        self.assertIn("<|im_start|>", text)
        self.assertEqual(tokenize(prompt=text)["tokens"], chat_ids)
        im_start = tokenize(prompt="<|im_start|>")["tokens"]
        self.assertEqual(len(im_start), 1, "one special token")
        self.assertIn(im_start[0], chat_ids)
        # As text, the marker is several ordinary tokens.
        as_text = tokenize(prompt=text, parse_special=False)["tokens"]
        self.assertNotIn(im_start[0], as_text)
        self.assertGreater(len(as_text), len(chat_ids))

    def test_prompt_ids_equal_llama_cpp_reference_ids(self):
        # tests/fixtures/reference: prompt ids from llama.cpp (llama-cpp-python 0.3.36) for
        # the same model, including a hand-formatted chat prompt tokenized with parse_special.
        path = os.path.join(h.SOURCE_DIR, "tests", "fixtures", "reference", "smollm2-135m-instruct-q4_1.json")
        with open(path) as f:
            fixtures = json.load(f)["prompts"]
        self.assertTrue(any(p["parse_special"] for p in fixtures))
        for p in fixtures:
            with self.subTest(prompt=p["name"]):
                ids = tokenize(prompt=p["text"], parse_special=p["parse_special"])["tokens"]
                self.assertEqual(ids, p["prompt_ids"])
                if p["parse_special"]:
                    # The default for completions is to parse special tokens, as llama.cpp's server does.
                    self.assertEqual(tokenize(prompt=p["text"])["tokens"], p["prompt_ids"])
                    r = client().completions.create(model=MODEL, prompt=p["text"], max_tokens=1)
                    self.assertEqual(r.usage.prompt_tokens, len(p["prompt_ids"]))

    def test_a_hand_formatted_chat_prompt_continues_as_the_chat_endpoint(self):
        chat = client().chat.completions.create(model=MODEL, messages=self.MESSAGES, max_tokens=8, temperature=0)
        chat_ids = tokenize(messages=self.MESSAGES)["tokens"]
        text = post("/detokenize", {"tokens": chat_ids}).json()["prompt"]
        comp = client().completions.create(model=MODEL, prompt=text, max_tokens=8, temperature=0)
        self.assertEqual(comp.usage.prompt_tokens, len(chat_ids))
        # Same ids in, same greedy tokens out; the chat endpoint stops at <|im_end|>.
        self.assertEqual(comp.choices[0].text[:len(chat.choices[0].message.content)], chat.choices[0].message.content)
        plain = client().completions.create(model=MODEL, prompt=text, max_tokens=8, temperature=0,
                                            extra_body={"parse_special": False})
        self.assertGreater(plain.usage.prompt_tokens, len(chat_ids))


class CachedTokens(unittest.TestCase):
    def test_cached_tokens_report_prefix_cache_hits(self):
        prompt = ("A long shared system prompt that the prefix cache should keep between requests. " * 12) + "Go:"
        first = client().completions.create(model=MODEL, prompt=prompt + " one", max_tokens=2, temperature=0)
        self.assertIsNotNone(first.usage.prompt_tokens_details)
        before = SERVER.metric("tessera_prefix_cache_hit_tokens_total")
        second = client().completions.create(model=MODEL, prompt=prompt + " two", max_tokens=2, temperature=0)
        hit = SERVER.metric("tessera_prefix_cache_hit_tokens_total") - before
        cached = second.usage.prompt_tokens_details.cached_tokens
        self.assertGreater(cached, 100)
        self.assertLess(cached, second.usage.prompt_tokens)
        self.assertEqual(cached, hit)
        chat = client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                                max_tokens=1)
        chat2 = client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                                 max_tokens=1)
        self.assertGreaterEqual(chat.usage.prompt_tokens_details.cached_tokens, 0)
        self.assertGreater(chat2.usage.prompt_tokens_details.cached_tokens, 100)


class Metrics(unittest.TestCase):
    def test_metrics_parse_as_distinct_families_of_their_declared_types(self):
        client().completions.create(model=MODEL, prompt="count me", max_tokens=2)
        text = SERVER.metrics()
        families = list(text_string_to_metric_families(text))
        names = [f.name for f in families]
        self.assertEqual(len(names), len(set(names)), sorted(n for n in names if names.count(n) > 1))
        declared = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
        self.assertEqual(len(families), len(declared))
        by_name = {f.name: f for f in families}
        self.assertEqual(by_name["tessera_engine_batch_tokens"].type, "counter")
        self.assertEqual(by_name["tessera_engine_last_batch_tokens"].type, "gauge")
        self.assertEqual(by_name["tessera_time_to_first_token_seconds"].type, "histogram")
        for f in families:
            self.assertTrue(f.samples, f.name)
        completions = [s for s in by_name["tessera_http_requests"].samples
                       if s.labels == {"endpoint": "/v1/completions", "status": "200"}]
        self.assertEqual(len(completions), 1)
        self.assertGreater(completions[0].value, 0)


class AccessLog(unittest.TestCase):
    def test_one_line_per_request_without_prompt_or_key(self):
        marker = "zebra-quartz-marker"
        r = client().completions.create(model=MODEL, prompt=f"Say {marker}", max_tokens=3, temperature=0)
        httpx.get(SERVER.url + "/v1/nothing?secret=hunter2", headers=AUTH)
        post("/v1/completions", {"model": MODEL, "prompt": marker, "max_tokens": "x"})
        for _ in range(3):
            list(client().completions.create(model=MODEL, prompt=marker, max_tokens=2, stream=True))
        lines = [line for line in SERVER.stderr_lines if "[access]" in line]
        mine = [line for line in lines if f"id={r.id} " in line]
        self.assertEqual(len(mine), 1, lines[-5:])
        fields = dict(kv.split("=", 1) for kv in mine[0].split("[access] ", 1)[1].split())
        self.assertEqual(fields["method"], "POST")
        self.assertEqual(fields["path"], "/v1/completions")
        self.assertEqual(fields["status"], "200")
        self.assertEqual(int(fields["prompt_tokens"]), r.usage.prompt_tokens)
        self.assertEqual(int(fields["completion_tokens"]), 3)
        self.assertGreater(float(fields["ttft_ms"]), 0)
        self.assertGreaterEqual(float(fields["duration_ms"]), float(fields["ttft_ms"]))
        self.assertTrue(any("path=/v1/nothing status=404" in line for line in lines))
        self.assertTrue(any("path=/v1/completions status=400" in line for line in lines))
        streamed = [line for line in lines if "completion_tokens=2 " in line]
        self.assertGreaterEqual(len(streamed), 3)
        log = "".join(SERVER.stderr_lines)
        self.assertNotIn(marker, log)
        self.assertNotIn(KEY, log)
        self.assertNotIn("hunter2", log)


if __name__ == "__main__":
    sys.exit(h.run_tests([BatchedPrompts, Tokenizer, SpecialTokens, CachedTokens, Metrics, AccessLog]))
