"""lm-eval (EleutherAI lm-evaluation-harness, pinned in scripts/install-deps.sh) against
`tessera serve` (issue 16 acceptance):

- its `local-completions` model runs a multiple-choice loglikelihood task and a
  generate_until task from local data committed in tests/lm_eval (no network), with
  `--batch_size 2` (batched prompts) and the tokenizer `tessera tokenizer export` writes
  (tokenized requests: lm-eval sends token ids, as with a Hugging Face tokenizer);
- every loglikelihood lm-eval logs (`--log_samples`) equals Tessera's offline prompt logprobs
  (`tessera eval --prompt-logprobs`, summed over the continuation's tokens) within 1e-5;
- every generation lm-eval logs equals the server's greedy completion of the same prompt.
"""
import glob
import json
import os
import subprocess
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(__file__))
import server_harness as h  # noqa: E402

h.require_environment(modules=("lm_eval", "tokenizers", "transformers", "openai"))
import openai  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

MODEL_FILE = os.path.join(os.environ.get("TESSERA_MODEL_DIR", os.path.expanduser("~/.cache/tessera/models")),
                          "SmolLM2-135M-Instruct.Q4_1.gguf")
TASKS = os.path.join(h.SOURCE_DIR, "tests", "lm_eval")
SERVER = None
MODEL = None
WORK = None


def setUpModule():
    global SERVER, MODEL, WORK
    SERVER = h.Server("max_queued_requests: 64", name="lmeval").start()
    MODEL = openai.OpenAI(base_url=SERVER.url + "/v1", api_key="none").models.list().data[0].id
    WORK = h.scratch_dir("tessera-lmeval-")


def tearDownModule():
    rc = SERVER.stop()
    assert rc == 0, f"server exit status {rc}:\n" + "".join(SERVER.stderr_lines[-20:])


def samples(out_dir, task):
    files = glob.glob(os.path.join(out_dir, "**", f"samples_{task}_*.jsonl"), recursive=True)
    assert len(files) == 1, files
    return [json.loads(line) for line in open(files[0])]


def arguments(sample):
    """(context, continuation) or (context, gen_kwargs): lm-eval 0.4 logs them either way."""
    args = sample["arguments"]
    if isinstance(args, dict):  # {"gen_args_0": {"arg_0": ..., "arg_1": ...}, ...}
        return [(a["arg_0"], a["arg_1"]) for a in args.values()]
    return [tuple(a) for a in args]


def offline_logprobs(prompts):
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        for i, ids in enumerate(prompts):
            f.write(json.dumps({"id": i, "tokens": ids}) + "\n")
    out = subprocess.run([h.TESSERA, "eval", "--quiet", "--prompt-logprobs", f.name],
                         capture_output=True, text=True, timeout=600)
    os.unlink(f.name)
    assert out.returncode == 0, out.stderr
    return {r["id"]: r["token_logprobs"] for r in map(json.loads, out.stdout.splitlines())}


class LmEval(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tokenizer_dir = os.path.join(WORK, "tokenizer")
        r = subprocess.run([h.TESSERA, "tokenizer", "export", MODEL_FILE,
                            os.path.join(cls.tokenizer_dir, "tokenizer.json")], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        cls.out = os.path.join(WORK, "results")
        model_args = ",".join([
            f"model={MODEL}", f"base_url={SERVER.url}/v1/completions", "tokenizer_backend=huggingface",
            f"tokenizer={cls.tokenizer_dir}", "tokenized_requests=True", "num_concurrent=1", "max_retries=1",
            "timeout=300"])
        env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   OPENAI_API_KEY="none", TOKENIZERS_PARALLELISM="false")
        cmd = [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", model_args,
               "--tasks", "tessera_mc,tessera_gen", "--include_path", TASKS, "--batch_size", "2",
               "--log_samples", "--output_path", cls.out]
        # The task files name their data relative to their own directory.
        cls.lm_eval = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, cwd=TASKS, env=env)
        print(cls.lm_eval.stdout[-3000:])
        assert cls.lm_eval.returncode == 0, cls.lm_eval.stderr[-6000:]

    def test_loglikelihoods_equal_offline_prompt_logprobs(self):
        tok = Tokenizer.from_file(os.path.join(self.tokenizer_dir, "tokenizer.json"))
        rows = samples(self.out, "tessera_mc")
        self.assertEqual(len(rows), 6)
        prompts, spans, reported = [], [], []
        for s in rows:
            for (context, continuation), resp in zip(arguments(s), s["resps"]):
                # lm-eval's _encode_pair: trailing spaces of the context move to the continuation.
                n = len(context) - len(context.rstrip())
                if n:
                    context, continuation = context[:-n], context[-n:] + continuation
                whole = tok.encode(context + continuation, add_special_tokens=False).ids
                ctxlen = len(tok.encode(context, add_special_tokens=False).ids)
                prompts.append(whole)
                spans.append(ctxlen)
                reported.append(float(resp[0][0]))
        want = offline_logprobs(prompts)
        worst = 0.0
        for i, (ctxlen, ll) in enumerate(zip(spans, reported)):
            offline = sum(want[i][ctxlen:])
            worst = max(worst, abs(offline - ll))
            self.assertLess(abs(offline - ll), 1e-5, (i, offline, ll))
        print(f"\nlm-eval loglikelihoods vs offline prompt logprobs: {len(reported)} requests, "
              f"max |diff| = {worst:.3g}")
        results = json.load(open(glob.glob(os.path.join(self.out, "**", "results_*.json"), recursive=True)[0]))
        acc = results["results"]["tessera_mc"]["acc,none"]
        print(f"tessera_mc acc = {acc}")
        self.assertGreaterEqual(acc, 0.0)

    def test_generations_equal_greedy_completions(self):
        client = openai.OpenAI(base_url=SERVER.url + "/v1", api_key="none", max_retries=0, timeout=120)
        rows = samples(self.out, "tessera_gen")
        self.assertEqual(len(rows), 4)
        for s in rows:
            context = arguments(s)[0][0]
            want = client.completions.create(model=MODEL, prompt=context, max_tokens=12, temperature=0,
                                             stop=["\n"]).choices[0].text
            self.assertEqual(s["resps"][0][0], want, context)


if __name__ == "__main__":
    sys.exit(h.run_tests([LmEval]))
