"""Server-side default sampling parameters (`server.defaults`, issue 16 part 6): a request
that omits a field gets the configured value, one that sends it keeps its own; chat's
max_completion_tokens counts as sending max_tokens; bad defaults fail `tessera config check`
naming the key.
"""
import os
import subprocess
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(__file__))
import server_harness as h  # noqa: E402

h.require_environment(modules=("openai",))

SERVER = None
MODEL = None
EOS = {"ignore_eos": True}


def setUpModule():
    global SERVER, MODEL
    SERVER = h.Server("defaults: {temperature: 0, max_tokens: 5, top_p: 0.9}", name="defaults").start()
    MODEL = client().models.list().data[0].id


def tearDownModule():
    SERVER.stop_and_check()


def client():
    return SERVER.openai_client(api_key="none", timeout=120)


class ServerDefaults(unittest.TestCase):
    def test_omitted_fields_get_the_defaults(self):
        prompt = "Once upon a time"
        r = client().completions.create(model=MODEL, prompt=prompt, extra_body=EOS)
        self.assertEqual(r.usage.completion_tokens, 5)  # not OpenAI's 16
        greedy = client().completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=5,
                                             extra_body=EOS)
        self.assertEqual(r.choices[0].text, greedy.choices[0].text)
        # Greedy whatever the seed: temperature 0 came from the config.
        for seed in (1, 2, 3):
            s = client().completions.create(model=MODEL, prompt=prompt, seed=seed, extra_body=EOS)
            self.assertEqual(s.choices[0].text, greedy.choices[0].text)

    def test_sent_fields_win(self):
        r = client().completions.create(model=MODEL, prompt="The sea is", max_tokens=3, extra_body=EOS)
        self.assertEqual(r.usage.completion_tokens, 3)
        # A sampled request still samples: among several seeds at temperature 1.5, not all are greedy.
        greedy = client().completions.create(model=MODEL, prompt="The sea is", max_tokens=8, extra_body=EOS)
        texts = {client().completions.create(model=MODEL, prompt="The sea is", max_tokens=8, temperature=1.5,
                                             top_p=1.0, seed=s, extra_body=EOS).choices[0].text for s in range(6)}
        self.assertGreater(len(texts - {greedy.choices[0].text}), 0)

    def test_chat(self):
        msgs = [{"role": "user", "content": "Write a long story about a dragon."}]
        r = client().chat.completions.create(model=MODEL, messages=msgs, extra_body=EOS)
        self.assertEqual(r.usage.completion_tokens, 5)
        r = client().chat.completions.create(model=MODEL, messages=msgs, max_completion_tokens=2, extra_body=EOS)
        self.assertEqual(r.usage.completion_tokens, 2)


class BadDefaults(unittest.TestCase):
    def check(self, yaml, expected):
        with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
            f.write(f"extends: {h.DEFAULT_STACK}\nserver:\n  defaults: {yaml}\n")
        r = subprocess.run([h.TESSERA, "config", "check", f.name], capture_output=True, text=True, timeout=60)
        os.unlink(f.name)
        self.assertNotEqual(r.returncode, 0, r.stdout)
        self.assertIn(expected, r.stderr + r.stdout)

    def test_out_of_range_and_unknown_keys_are_named(self):
        self.check("{top_p: 2}", "server.defaults.top_p")
        self.check("{temperature: hot}", "server.defaults.temperature")
        self.check("{max_tokens: 0}", "server.defaults.max_tokens")
        self.check("{temprature: 0}", "temperature")  # did you mean


if __name__ == "__main__":
    sys.exit(h.run_tests([ServerDefaults, BadDefaults]))
