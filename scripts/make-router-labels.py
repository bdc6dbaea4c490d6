#!/usr/bin/env python3
"""Regenerates the router's labelled set (data/router/labelled.jsonl), RouteLLM-style.

Every prompt has an answer that can be checked mechanically, built from text that Debian
packages ship (iso-codes: /usr/share/iso-codes/json/iso_3166-1.json, iso_4217.json,
iso_639-2.json; tzdata through Python's zoneinfo: city -> continent; Python's calendar
module: weekday and month names, month lengths) or computed (arithmetic, counting letters
and words). Both real models answer every prompt through a real `tessera serve` with two
deployments (greedy, max_tokens 12): SmolLM2-135M-Instruct Q4_1 (`small`) and Gemma 3 270M
Q4_K_M (`large`). The label is "large" when only the large model answers correctly, else
"small" (both right, only the small one right, or both wrong: the large model would not
help, so the cheap one is as good).

The Gemma 3 270M on PyPI is a *base* model (no instruction tuning, no chat template): asked
through a chat template it repeats the question. So by default (`--format completion`) each
question is asked the way a base model is used, as a few-shot completion prompt
(FEW_SHOT + "Question: ...\nAnswer:", stop at the end of the line, `/v1/completions`), the
same text to both models, and that text is the labelled prompt the router scores.
`--format chat` asks the bare question through each model's chat template instead (for an
instruction-tuned large model).

    scripts/make-router-labels.py --tessera build/bin/tessera --out data/router/labelled.jsonl

The prompts are drawn with a fixed seed, so a rerun asks the same questions; the outputs are
greedy, so it gets the same labels on the same stack.
"""
import argparse
import calendar
import concurrent.futures
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import zoneinfo

ISO = "/usr/share/iso-codes/json"
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
NUMBER_WORDS = {w: i for i, w in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
    "sixteen seventeen eighteen nineteen twenty".split())}


# The examples that teach a base model the answer format (`--format completion`). None of
# their questions is asked (questions() drops a drawn one that equals an example's).
FEW_SHOT_EXAMPLES = [
    ("What is 12 + 30? Answer briefly.", "42"),
    ("On which continent is the city of Lima? Answer briefly.", "South America"),
    ("Which country has the two-letter country code NO? Answer briefly.", "Norway"),
    ("How many letters are in the word 'Chile'? Answer briefly.", "5"),
]
FEW_SHOT = "".join(f"Question: {q}\nAnswer: {a}\n" for q, a in FEW_SHOT_EXAMPLES)


def completion_prompt(question):
    return f"{FEW_SHOT}Question: {question}\nAnswer:"


def load_iso(name, key):
    with open(os.path.join(ISO, name)) as f:
        return json.load(f)[key]


def questions(rng, per_family):
    """(family, prompt, answer, kind) tuples; kind "int" compares the first number, "text" a substring."""
    out = []
    add = lambda fam, q, a, kind="text": out.append((fam, q, str(a), kind))
    for _ in range(per_family):  # arithmetic of growing size
        digits = rng.choice([1, 1, 2, 2, 3])
        a, b = rng.randint(1, 10 ** digits - 1), rng.randint(1, 10 ** digits - 1)
        add("add", f"What is {a} + {b}?", a + b, "int")
    for _ in range(per_family):
        a, b = rng.randint(2, 12), rng.randint(2, rng.choice([9, 12, 25]))
        add("multiply", f"What is {a} times {b}?", a * b, "int")
    for _ in range(per_family):
        a = rng.randint(10, 99)
        b = rng.randint(1, a)
        add("subtract", f"What is {a} minus {b}?", a - b, "int")
    days = list(calendar.day_name)
    months = list(calendar.month_name)[1:]
    for _ in range(per_family):
        i, k = rng.randrange(7), rng.choice([1, 1, 2, 3])
        if k == 1:
            add("weekday", f"Which day of the week comes after {days[i]}?", days[(i + 1) % 7])
        else:
            add("weekday", f"Which day of the week is {k} days after {days[i]}?", days[(i + k) % 7])
    for _ in range(per_family):
        i = rng.randrange(12)
        if rng.random() < 0.5:
            add("month", f"Which month comes after {months[i]}?", months[(i + 1) % 12])
        else:
            add("month", f"How many days are there in {months[i]} in a non-leap year?",
                calendar.monthrange(2025, i + 1)[1], "int")
    continents = {"Europe": "Europe", "Africa": "Africa", "Asia": "Asia", "Australia": "Australia"}
    cities = sorted(z for z in zoneinfo.available_timezones()
                    if z.split("/")[0] in continents and z.count("/") == 1 and "_" not in z.split("/")[1]
                    and not any(c.isdigit() for c in z))
    for z in rng.sample(cities, min(per_family, len(cities))):
        region, city = z.split("/")
        add("continent", f"On which continent is the city of {city}?", continents[region])
    countries = [c for c in load_iso("iso_3166-1.json", "3166-1") if "," not in c["name"] and "(" not in c["name"]]
    for c in rng.sample(countries, per_family):
        add("country-code", f"Which country has the two-letter country code {c['alpha_2']}?", c["name"])
    languages = [l for l in load_iso("iso_639-2.json", "639-2") if "alpha_2" in l and ";" not in l["name"]]
    for l in rng.sample(languages, min(per_family, len(languages))):
        add("language-code", f"Which language has the ISO 639-1 code '{l['alpha_2']}'?", l["name"])
    currencies = [c for c in load_iso("iso_4217.json", "4217") if len(c["name"].split()) <= 3]
    for c in rng.sample(currencies, min(per_family, len(currencies))):
        add("currency-code", f"What is the three-letter ISO 4217 code of the {c['name']}?", c["alpha_3"])
    words = sorted({w for c in countries for w in re.findall(r"[A-Za-z]{3,}", c["name"])})
    for w in rng.sample(words, per_family):
        if rng.random() < 0.5:
            add("letters", f"What is the first letter of the word '{w}'?", w[0])
        else:
            add("letters", f"How many letters are in the word '{w}'?", len(w), "int")
    for _ in range(per_family):
        n = rng.randint(2, 8)
        sentence = " ".join(rng.sample(words, n))
        add("count-words", f"How many words are in this text: \"{sentence}\"?", n, "int")
    examples = {q for q, _ in FEW_SHOT_EXAMPLES}
    return [(f, q + " Answer briefly.", a, k) for f, q, a, k in out if q + " Answer briefly." not in examples]


def correct(output, answer, kind):
    text = output.strip().lower()
    if kind == "int":
        # The last number the model says (digits or a small number word): "718 + 964 = 1682".
        found = re.findall(r"-?\d[\d,]*\d|-?\d|\b(?:" + "|".join(NUMBER_WORDS) + r")\b", text)
        if not found:
            return False
        tok = found[-1]
        value = NUMBER_WORDS[tok] if tok in NUMBER_WORDS else int(tok.replace(",", ""))
        return value == int(answer)
    if len(answer) == 1:  # a letter: the answer's first letter-only word, or a quoted letter
        m = re.search(r"['\"]([a-z])['\"]|\b([a-z])\b", text)
        return bool(m) and (m.group(1) or m.group(2)) == answer.lower()
    return re.search(r"(?<![a-z])" + re.escape(answer.lower()) + r"(?![a-z])", text) is not None


LLAMA_TEMPLATES = {"small": None, "large": "gemma"}  # SmolLM2's GGUF has its template; Gemma's has none


def start_llama_server(binary, model_path, template):
    """llama.cpp's server on one GGUF (the reference stack), greedy, 4 parallel slots."""
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [binary, "-m", model_path, "--port", str(port), "--host", "127.0.0.1", "-t", "2", "-np", "4",
           "-c", "4096"]
    # A GGUF's own template runs as Jinja; a built-in one is named without --jinja (with it,
    # "gemma" would be read as the template text itself, and Gemma would answer nonsense).
    cmd += ["--chat-template", template] if template else ["--jinja"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return proc, port
        except Exception:
            time.sleep(1)
    proc.kill()
    sys.exit(f"llama-server on {model_path} did not start")


def start_server(tessera):
    tmp = tempfile.mkdtemp(prefix="tessera-router-labels-")
    config = os.path.join(tmp, "gw.yaml")
    with open(config, "w") as f:
        f.write(f"deployments:\n"
                f"  small: {{extends: {SOURCE}/configs/smollm2-cpu.yaml}}\n"
                f"  large: {{extends: {SOURCE}/configs/gemma3-270m.yaml}}\n"
                f"server: {{max_queued_requests: 1024}}\n")
    proc = subprocess.Popen([tessera, "serve", "--config", config, "--port", "0"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    port = []
    ready = threading.Event()

    def pump():
        for line in proc.stderr:
            m = re.search(r"listening on http://[\d.]+:(\d+)", line)
            if m:
                port.append(int(m.group(1)))
                ready.set()
        ready.set()

    threading.Thread(target=pump, daemon=True).start()
    started = ready.wait(600) and port
    shutil.rmtree(tmp, ignore_errors=True)  # the server has read its config by now
    if not started:
        proc.kill()
        sys.exit("tessera serve did not start")
    return proc, port[0]


def labelling_request(prompt, fmt, model):
    """(path, body) of the greedy request a prompt is labelled with: a chat turn, or (fmt
    "completion") the few-shot text completed up to the line's end. bench/router_eval.py asks
    the served router the same way."""
    if fmt == "completion":
        path, body = "/v1/completions", {"prompt": prompt, "stop": ["\n"]}
    else:
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}]}
    body.update({"model": model, "max_tokens": 12, "temperature": 0, "seed": 0})
    return path, body


def answer_text(choice):
    return choice["text"] if "text" in choice else choice["message"]["content"]


def ask(port, model, prompt, fmt):
    path, body = labelling_request(prompt, fmt, model)
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return answer_text(json.load(r)["choices"][0])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tessera", default=os.path.join(SOURCE, "build", "bin", "tessera"))
    ap.add_argument("--out", default=os.path.join(SOURCE, "data", "router", "labelled.jsonl"))
    ap.add_argument("--per-family", type=int, default=20, help="questions per family (11 families)")
    ap.add_argument("--seed", type=int, default=15)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--llama-server", default="",
                    help="answer with llama.cpp's llama-server (this binary) on the same GGUF files instead of tessera")
    ap.add_argument("--label-only", action="store_true",
                    help="only label the prompts both models have answered (the answer files next to --out)")
    ap.add_argument("--models", default=os.path.expanduser("~/.cache/tessera/models"))
    ap.add_argument("--format", choices=("completion", "chat"), default="completion",
                    help="completion: few-shot prompts to /v1/completions (the large model is a base "
                         "model); chat: the bare question through each model's chat template")
    args = ap.parse_args()
    qs = questions(random.Random(args.seed), args.per_family)
    if args.format == "completion":  # the labelled prompt is the text both models complete
        qs = [(f, completion_prompt(q), a, k) for f, q, a, k in qs]
    # Asked in a shuffled order and kept as they arrive (one JSONL per model next to --out), so
    # an interrupted run resumes and a partial one still covers every family.
    order = list(range(len(qs)))
    random.Random(args.seed + 1).shuffle(order)
    t0 = time.time()
    answers = {}
    stem = os.path.splitext(os.path.abspath(args.out))[0]
    os.makedirs(os.path.dirname(stem), exist_ok=True)

    def answer_all(name, ask_one):
        path = f"{stem}.answers-{name}.jsonl"
        got = {}
        if os.path.exists(path):
            with open(path) as f:
                for line in f:
                    r = json.loads(line)
                    got[r["prompt"]] = r["output"]
        lock = threading.Lock()
        with open(path, "a") as f:
            def one(i):
                prompt = qs[i][1]
                if prompt not in got:
                    out = ask_one(prompt)
                    with lock:
                        got[prompt] = out
                        f.write(json.dumps({"prompt": prompt, "output": out}, ensure_ascii=False) + "\n")
                        f.flush()
            with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
                list(pool.map(one, order))
        answers[name] = got

    if args.label_only:
        # Label what both models have answered so far (an interrupted run's files).
        for name in ("small", "large"):
            with open(f"{stem}.answers-{name}.jsonl") as f:
                answers[name] = {r["prompt"]: r["output"] for r in map(json.loads, f)}
    elif args.llama_server:
        files = {"small": "SmolLM2-135M-Instruct.Q4_1.gguf", "large": "gemma-3-270m-q4_k_m.gguf"}
        servers = {name: start_llama_server(args.llama_server, os.path.join(args.models, file), LLAMA_TEMPLATES[name])
                   for name, file in files.items()}
        try:
            # Both models at once: each server has its own threads.
            threads = [threading.Thread(target=answer_all, args=(name, lambda p, port=port, name=name: ask(port, name, p, args.format)))
                       for name, (_, port) in servers.items()]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        finally:
            for proc, _ in servers.values():
                proc.terminate()
                proc.wait()
    else:
        proc, port = start_server(args.tessera)
        try:
            for name in ("small", "large"):
                answer_all(name, lambda p, name=name: ask(port, name, p, args.format))
        finally:
            proc.terminate()
            proc.wait()
    # Small families (weekday, month) draw the same question more than once; a repeated prompt
    # would sit in both the training and the held-out split, so each is labelled once.
    qs = list({q[1]: q for q in reversed(qs)}.values())[::-1]
    qs = [q for q in qs if q[1] in answers["small"] and q[1] in answers["large"]]
    small = [answers["small"][q[1]] for q in qs]
    large = [answers["large"][q[1]] for q in qs]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    counts = {}
    with open(args.out, "w") as f:
        for (family, prompt, answer, kind), s, l in zip(qs, small, large):
            sc, lc = correct(s, answer, kind), correct(l, answer, kind)
            label = "large" if lc and not sc else "small"
            c = counts.setdefault(family, [0, 0, 0, 0])
            c[0] += 1
            c[1] += sc
            c[2] += lc
            c[3] += label == "large"
            f.write(json.dumps({"prompt": prompt, "format": args.format, "label": label, "family": family, "answer": answer,
                                "small_correct": sc, "large_correct": lc, "small_output": s,
                                "large_output": l}, ensure_ascii=False) + "\n")
    print(f"{len(qs)} prompts in {time.time() - t0:.0f} s -> {args.out}")
    print(f"{'family':15} {'n':>4} {'small ok':>9} {'large ok':>9} {'label large':>12}")
    for fam, (n, s, l, g) in counts.items():
        print(f"{fam:15} {n:4} {s:9} {l:9} {g:12}")
    tot = [sum(c[i] for c in counts.values()) for i in range(4)]
    print(f"{'total':15} {tot[0]:4} {tot[1]:9} {tot[2]:9} {tot[3]:12}")


if __name__ == "__main__":
    main()
