"""LangChain's `OpenAI` LLM (langchain-openai, pinned in scripts/install-deps.sh) against
`tessera serve`: `OpenAI.batch` sends several prompts in one /v1/completions request (a
prompt list); each answer equals the same prompt sent alone, in order. Also `invoke` and
`stream`.
"""
import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(__file__))
import server_harness as h  # noqa: E402

h.require_environment(modules=("openai", "langchain_openai", "httpx"))
import httpx  # noqa: E402
from langchain_openai import OpenAI  # noqa: E402

SERVER = None
MODEL = None
PROMPTS = ["The capital of France is", "Water boils at", "My favourite colour is", "Two plus two equals",
           "The first month of the year is"]


def setUpModule():
    global SERVER, MODEL
    SERVER = h.Server("max_queued_requests: 64", name="langchain").start()
    MODEL = httpx.get(SERVER.url + "/v1/models").json()["data"][0]["id"]


def tearDownModule():
    rc = SERVER.stop()
    assert rc == 0, f"server exit status {rc}:\n" + "".join(SERVER.stderr_lines[-20:])


def llm(**kw):
    return OpenAI(model=MODEL, base_url=SERVER.url + "/v1", api_key="none", temperature=0, max_tokens=8,
                  max_retries=0, **kw)


def requests_so_far():
    m = SERVER.metrics()
    total = 0
    for line in m.splitlines():
        if line.startswith('tessera_http_requests_total{endpoint="/v1/completions"'):
            total += float(line.rsplit(" ", 1)[1])
    return total


class LangChainBatch(unittest.TestCase):
    def test_batch_equals_each_prompt_alone(self):
        alone = [llm().invoke(p) for p in PROMPTS]
        before = requests_so_far()
        # batch_size 20 (LangChain's default) puts all five prompts in one request.
        batched = llm().batch(PROMPTS)
        self.assertEqual(requests_so_far() - before, 1)  # one HTTP request for the batch
        self.assertEqual(batched, alone)
        self.assertTrue(all(isinstance(t, str) and t for t in batched))

    def test_generate_splits_into_sub_batches(self):
        before = requests_so_far()
        result = llm(batch_size=2).generate(PROMPTS)
        self.assertEqual(requests_so_far() - before, 3)  # 2 + 2 + 1
        self.assertEqual([g[0].text for g in result.generations], [llm().invoke(p) for p in PROMPTS])
        usage = result.llm_output["token_usage"]
        self.assertEqual(usage["completion_tokens"], sum(
            httpx.post(SERVER.url + "/v1/completions", json={"model": MODEL, "prompt": p, "max_tokens": 8,
                                                             "temperature": 0},
                       timeout=h.request_timeout(120)).json()["usage"]["completion_tokens"]
            for p in PROMPTS))

    def test_stream(self):
        chunks = list(llm().stream(PROMPTS[0]))
        self.assertGreater(len(chunks), 1)
        self.assertEqual("".join(chunks), llm().invoke(PROMPTS[0]))


if __name__ == "__main__":
    sys.exit(h.run_tests([LangChainBatch]))
