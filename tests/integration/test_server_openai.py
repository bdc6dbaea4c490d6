"""End-to-end: the official `openai` Python client against `tessera serve` on the default stack.

Completions and chat, streaming and not, stop strings (matched across token boundaries),
n > 1, logprobs, seed reproducibility, and 32 concurrent greedy requests that must equal the
offline engine's output (`tessera generate --json`).
"""
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(__file__))
import server_harness as h  # noqa: E402

h.require_environment()
import openai  # noqa: E402

SERVER = None
MODEL = None


def setUpModule():
    global SERVER, MODEL
    SERVER = h.Server("max_queued_requests: 64", name="openai").start()
    MODEL = openai.OpenAI(base_url=SERVER.url + "/v1", api_key="unused").models.list().data[0].id


def tearDownModule():
    rc = SERVER.stop()
    assert rc == 0, f"server exit status {rc}:\n" + "".join(SERVER.stderr_lines[-20:])


def client():
    return openai.OpenAI(base_url=SERVER.url + "/v1", api_key="unused", max_retries=0, timeout=120)


PROMPT = "The three primary colors are"


class Completions(unittest.TestCase):
    def test_models_lists_the_served_model(self):
        models = client().models.list().data
        self.assertEqual(len(models), 1)
        self.assertEqual(models[0].id, MODEL)
        self.assertEqual(client().models.retrieve(MODEL).id, MODEL)

    def test_greedy_completion_has_text_usage_and_length_finish(self):
        r = client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
        self.assertEqual(r.object, "text_completion")
        self.assertEqual(len(r.choices), 1)
        self.assertTrue(r.choices[0].text.strip())
        self.assertEqual(r.choices[0].finish_reason, "length")
        self.assertEqual(r.usage.completion_tokens, 12)
        self.assertGreater(r.usage.prompt_tokens, 3)
        self.assertEqual(r.usage.total_tokens, r.usage.prompt_tokens + 12)

    def test_streamed_completion_equals_the_whole_one(self):
        whole = client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
        chunks = list(client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                                  stream=True, stream_options={"include_usage": True}))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        self.assertEqual(text, whole.choices[0].text)
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        self.assertEqual(finishes, ["length"])
        self.assertIsNotNone(chunks[-1].usage, "include_usage puts usage in the last chunk")
        self.assertEqual(chunks[-1].usage.completion_tokens, 12)
        self.assertEqual(chunks[-1].choices, [])

    def test_stop_string_across_token_boundary_is_cut_and_not_emitted(self):
        full = client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0, logprobs=0)
        tokens = full.choices[0].logprobs.tokens
        text = full.choices[0].text
        # A stop string made of the end of token 3 and the start of token 4.
        k = next(i for i in range(2, len(tokens) - 1) if len(tokens[i].strip()) >= 2 and len(tokens[i + 1]) >= 2)
        stop = tokens[k][-2:] + tokens[k + 1][:2]
        expected = text[:text.index(stop)]
        r = client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0,
                                        stop=[stop, "never-appears-here"])
        self.assertEqual(r.choices[0].text, expected)
        self.assertEqual(r.choices[0].finish_reason, "stop")
        streamed = list(client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0,
                                                    stop=stop, stream=True))
        self.assertEqual("".join(c.choices[0].text for c in streamed), expected)
        self.assertNotIn(stop, "".join(c.choices[0].text for c in streamed))
        self.assertEqual(streamed[-1].choices[0].finish_reason, "stop")

    def test_characters_split_across_tokens_stream_whole(self):
        # Byte-level BPE spells each of these emoji with several tokens.
        kw = dict(model=MODEL, prompt="Emoji list: \U0001F600 \U0001F389 \U0001F40D \U0001F355 \U0001F680",
                  max_tokens=15, temperature=0)
        whole = client().completions.create(**kw).choices[0].text
        pieces = [c.choices[0].text for c in client().completions.create(stream=True, **kw)]
        self.assertEqual("".join(pieces), whole)
        self.assertTrue(any(ord(ch) > 0xFFFF for ch in whole), whole)
        self.assertGreater(sum(1 for p in pieces if p), 1)
        # Only the last piece may end in a character that max_tokens cut short.
        for p in pieces[:-1]:
            self.assertNotIn("\ufffd", p)

    def test_n_samples_are_independent_and_indexed(self):
        r = client().completions.create(model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=1.0,
                                        n=3, seed=11)
        self.assertEqual(sorted(c.index for c in r.choices), [0, 1, 2])
        self.assertGreaterEqual(len({c.text for c in r.choices}), 2, [c.text for c in r.choices])
        self.assertLessEqual(r.usage.completion_tokens, 30)
        self.assertGreater(r.usage.completion_tokens, 3)

    def test_logprobs_match_the_tokens(self):
        r = client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
        lp = r.choices[0].logprobs
        self.assertEqual(len(lp.tokens), 6)
        self.assertEqual("".join(lp.tokens), r.choices[0].text)
        self.assertEqual(len(lp.top_logprobs), 6)
        for chosen, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
            self.assertLessEqual(logprob, 0.0)
            self.assertEqual(len(top), 3)
            # Greedy: the chosen token is the most likely one.
            self.assertAlmostEqual(max(top.values()), logprob, places=4)
            self.assertIn(chosen, top)
        self.assertEqual(lp.text_offset[0], 0)

    def test_same_seed_same_text_when_sampling(self):
        kw = dict(model=MODEL, prompt="Write a story about a dragon:", max_tokens=16, temperature=0.9, seed=1234)
        a = client().completions.create(**kw).choices[0].text
        b = client().completions.create(**kw).choices[0].text
        self.assertEqual(a, b)

    def test_32_concurrent_greedy_requests_equal_the_offline_engine(self):
        topics = ["the sea", "bread", "chess", "bees", "the moon", "rivers", "trains", "music"]
        prompts = [f"Here is a fact about {topics[i % 8]} number {i}:" for i in range(32)]
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "prompts.jsonl")
            with open(path, "w") as f:
                for i, p in enumerate(prompts):
                    f.write(json.dumps({"id": str(i), "prompt": p, "max_tokens": 12}) + "\n")
            out = subprocess.run([h.TESSERA, "generate", "--config", SERVER.config, "--prompts-file", path,
                                  "--json", "--temperature", "0"], capture_output=True, text=True, check=True)
        offline = {j["id"]: j["text"] for j in map(json.loads, out.stdout.splitlines())}

        async def one(aclient, i):
            r = await aclient.completions.create(model=MODEL, prompt=prompts[i], max_tokens=12, temperature=0)
            return r.choices[0].text

        async def all_at_once():
            aclient = openai.AsyncOpenAI(base_url=SERVER.url + "/v1", api_key="unused", max_retries=0, timeout=300)
            return await asyncio.gather(*(one(aclient, i) for i in range(32)))

        served = asyncio.run(all_at_once())
        same = sum(served[i] == offline[str(i)] for i in range(32))
        self.assertEqual(same, 32, [(served[i], offline[str(i)]) for i in range(32) if served[i] != offline[str(i)]])


class Chat(unittest.TestCase):
    MESSAGES = [{"role": "system", "content": "You answer in one short sentence."},
                {"role": "user", "content": "What is the capital of France?"}]

    def test_chat_answers_through_the_template(self):
        r = client().chat.completions.create(model=MODEL, messages=self.MESSAGES, max_tokens=24, temperature=0)
        self.assertEqual(r.object, "chat.completion")
        self.assertEqual(r.choices[0].message.role, "assistant")
        self.assertIn("Paris", r.choices[0].message.content)
        self.assertIn(r.choices[0].finish_reason, ("stop", "length"))
        self.assertGreater(r.usage.prompt_tokens, 10)

    def test_streamed_chat_equals_the_whole_one(self):
        whole = client().chat.completions.create(model=MODEL, messages=self.MESSAGES, max_completion_tokens=24,
                                                 temperature=0)
        chunks = list(client().chat.completions.create(model=MODEL, messages=self.MESSAGES,
                                                       max_completion_tokens=24, temperature=0, stream=True,
                                                       stream_options={"include_usage": True}))
        self.assertEqual(chunks[0].choices[0].delta.role, "assistant")
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        self.assertEqual(text, whole.choices[0].message.content)
        self.assertEqual(chunks[-1].usage.completion_tokens, whole.usage.completion_tokens)

    def test_chat_logprobs(self):
        r = client().chat.completions.create(model=MODEL, messages=self.MESSAGES, max_tokens=5, temperature=0,
                                             logprobs=True, top_logprobs=2)
        content = r.choices[0].logprobs.content
        self.assertEqual(len(content), r.usage.completion_tokens)
        self.assertEqual("".join(t.token for t in content), r.choices[0].message.content)
        for t in content:
            self.assertEqual(len(t.top_logprobs), 2)
            self.assertEqual(bytes(t.bytes).decode(errors="replace"), t.token)

    def test_chat_stop_and_seeded_n(self):
        kw = dict(model=MODEL, messages=self.MESSAGES, max_tokens=12, temperature=0.8, seed=5, n=2)
        a = client().chat.completions.create(**kw)
        b = client().chat.completions.create(**kw)
        self.assertEqual([c.message.content for c in a.choices], [c.message.content for c in b.choices])
        r = client().chat.completions.create(model=MODEL, messages=self.MESSAGES, max_tokens=24, temperature=0,
                                             stop=["Paris"])
        self.assertNotIn("Paris", r.choices[0].message.content)
        self.assertEqual(r.choices[0].finish_reason, "stop")

    def test_errors_come_back_as_openai_errors(self):
        with self.assertRaises(openai.NotFoundError):
            client().chat.completions.create(model="no-such-model", messages=self.MESSAGES)
        with self.assertRaises(openai.BadRequestError) as e:
            client().chat.completions.create(model=MODEL, messages=[])
        self.assertEqual(e.exception.body["param"], "messages")
        with self.assertRaises(openai.BadRequestError) as e:
            client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=100000)
        self.assertEqual(e.exception.body["param"], "max_tokens")


if __name__ == "__main__":
    sys.exit(h.run_tests([Completions, Chat]))
