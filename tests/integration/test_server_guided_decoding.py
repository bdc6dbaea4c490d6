"""Regex and grammar constraints and the enforced JSON Schema keywords on `tessera serve`
(issue 16), on the real model, sent the way the anchors' users send them:

- vLLM's `guided_regex`, `guided_choice`, `guided_grammar`, `guided_json` and
  `structured_outputs: {regex, choice, grammar}` as extra body fields (the openai client's
  `extra_body`) on /v1/completions and /v1/chat/completions: every output matches the regex
  (Python's `re`), is one of the choices;
- llama.cpp's `"grammar": "..."` with llama.cpp's arithmetic, JSON and list example grammars:
  every finished output is accepted by an independent checker written here (a recursive
  parser for the arithmetic lines, `json.loads`, a line check for the list);
- JSON Schema minimum / maximum / exclusiveMinimum / exclusiveMaximum, pattern, minItems /
  maxItems, minLength / maxLength on 50 varied prompts (greedy and sampled, chat and
  completions): every answer validates with the `jsonschema` package;
- bad regexes, grammars and combinations are a 400 naming the field (with the position, or the
  line and column), and the server goes on serving.
"""
import concurrent.futures as cf
import functools
import json
import os
import re
import sys
import unittest

sys.path.insert(0, os.path.dirname(__file__))
import server_harness as h  # noqa: E402

h.require_environment(modules=("openai", "httpx", "jsonschema"))
import httpx  # noqa: E402
import jsonschema  # noqa: E402

SERVER = None
MODEL = None
WORKERS = 8  # concurrent requests: the engine batches them


def setUpModule():
    global SERVER, MODEL
    SERVER = h.Server("max_queued_requests: 128", name="guided").start()
    MODEL = client().models.list().data[0].id


def tearDownModule():
    SERVER.stop_and_check()


def client():
    return SERVER.openai_client(api_key="unused", timeout=300)


def parallel(fn, items):
    with cf.ThreadPoolExecutor(WORKERS) as pool:
        return list(pool.map(fn, items))


def complete(prompt, max_tokens=48, **extra):
    r = client().completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                    extra_body=extra)
    return r.choices[0].text, r.choices[0].finish_reason


def chat(prompt, max_tokens=48, temperature=0, seed=None, **extra):
    r = client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                         max_tokens=max_tokens, temperature=temperature, seed=seed,
                                         extra_body=extra)
    return r.choices[0].message.content, r.choices[0].finish_reason


# Finite languages: every output ends within max_tokens.
REGEXES = [
    (r"\d{3}-\d{4}", "Write a phone number:"),
    (r"20\d{2}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])", "Today's date is"),
    (r"[a-z]{2,10}@[a-z]{2,8}\.(com|org|net)", "Contact email:"),
    (r"(yes|no), because [a-z ]{5,40}\.", "Is the sky blue? Answer:"),
    (r"[A-Z][a-z]{1,12} is [0-9]{1,3} years old\.", "Tell me someone's age."),
]


class Regex(unittest.TestCase):
    def test_outputs_match_on_both_endpoints_and_both_spellings(self):
        def run(item):
            i, (pattern, prompt) = item
            kind = i % 4
            if kind == 0:
                text, finish = complete(prompt, guided_regex=pattern)
            elif kind == 1:
                text, finish = chat(prompt, guided_regex=pattern)
            elif kind == 2:
                text, finish = complete(prompt, structured_outputs={"regex": pattern})
            else:
                text, finish = chat(prompt, structured_outputs={"regex": pattern}, temperature=0.8, seed=i)
            return pattern, text, finish

        items = [(i, REGEXES[i % len(REGEXES)]) for i in range(20)]
        for pattern, text, finish in parallel(run, items):
            self.assertEqual(finish, "stop", f"/{pattern}/: {text!r}")
            self.assertRegex(text, "^(?:" + pattern + r")\Z")

    def test_choice_picks_one_of_the_strings(self):
        choices = ["positive", "negative", "neutral", "it's (complicated)?"]
        prompts = ["I loved the film.", "The food was cold.", "It rained.", "Best day ever!", "Meh."]

        def run(item):
            i, prompt = item
            if i % 2:
                return chat(f"Sentiment of: {prompt}", guided_choice=choices)
            return complete(f"Review: {prompt}\nSentiment:", structured_outputs={"choice": choices})

        for text, finish in parallel(run, list(enumerate(prompts * 2))):
            self.assertIn(text, choices)
            self.assertEqual(finish, "stop")


# llama.cpp's example grammars (grammars/*.gbnf there), written out from the published syntax.
ARITHMETIC = r"""root  ::= (expr "=" ws term "\n")+
expr  ::= term ([-+*/] term)*
term  ::= ident | num | "(" ws expr ")" ws
ident ::= [a-z] [a-z0-9_]*
num   ::= [0-9]+ ws
ws    ::= [ \t\n]*
"""

JSON_GRAMMAR = r"""root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null") ws

object ::=
  "{" ws (
            string ":" ws value
    ("," ws string ":" ws value)*
  )? "}" ws

array  ::=
  "[" ws (
            value
    ("," ws value)*
  )? "]" ws

string ::=
  "\"" (
    [^"\\\x7F\x00-\x1F] |
    "\\" (["\\bfnrt] | "u" [0-9a-fA-F]{4}) # escapes
  )* "\"" ws

number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9] [1-7]{0,15})? ws

# Optional space: by convention, applied in this grammar after literal chars when allowed
ws ::= | " " | "\n" [ \t]{0,20}
"""

LIST = r"""root ::= item+

# Excludes various line break characters
item ::= "- " [^\r\n\x0b\x0c\x85\u2028\u2029]+ "\n"
"""


def arithmetic_ok(text):
    """The arithmetic grammar parsed here by hand, independently of Tessera: each rule gives the
    set of positions it can end at from a start (the grammar is ambiguous: `ws` may take the
    line's "\n")."""
    n = len(text)

    @functools.lru_cache(None)
    def ws(i):
        ends = {i}
        while i < n and text[i] in " \t\n":
            i += 1
            ends.add(i)
        return frozenset(ends)

    def ident(i):
        if not (i < n and "a" <= text[i] <= "z"):
            return set()
        j, ends = i + 1, {i + 1}
        while j < n and (text[j].isdigit() or "a" <= text[j] <= "z" or text[j] == "_"):
            j += 1
            ends.add(j)
        return ends

    def num(i):
        ends, j = set(), i
        while j < n and text[j].isdigit():
            j += 1
            ends |= ws(j)
        return ends

    @functools.lru_cache(None)
    def term(i):
        ends = ident(i) | num(i)
        if i < n and text[i] == "(":
            for a in ws(i + 1):
                for b in expr(a):
                    if b < n and text[b] == ")":
                        ends |= ws(b + 1)
        return frozenset(ends)

    @functools.lru_cache(None)
    def expr(i):
        ends, frontier = set(), set(term(i))
        while frontier:
            e = frontier.pop()
            if e in ends:
                continue
            ends.add(e)
            if e < n and text[e] in "-+*/":
                frontier |= term(e + 1)
        return frozenset(ends)

    def line(i):
        ends = set()
        for a in expr(i):
            if a < n and text[a] == "=":
                for b in ws(a + 1):
                    ends |= {c + 1 for c in term(b) if c < n and text[c] == "\n"}
        return ends

    frontier, seen = {0}, set()
    while frontier:
        for e in line(frontier.pop()):
            if e == n:
                return True
            if e not in seen:
                seen.add(e)
                frontier.add(e)
    return False


def list_ok(text):
    return re.fullmatch(r"(- [^\r\n\x0b\x0c\x85\u2028\u2029]+\n)+", text) is not None


class Grammar(unittest.TestCase):
    def run_grammar(self, grammar, prompts, check, field, max_tokens=96, completions=None):
        def run(item):
            i, prompt = item
            if i % 2:
                return chat(prompt, max_tokens=max_tokens, **{field: grammar})
            return complete(prompt, max_tokens=max_tokens, **{field: grammar})

        for text, finish in parallel(run, list(enumerate(prompts))):
            self.assertIn(finish, ("stop", "length"))
            if finish == "stop":
                self.assertTrue(check(text), f"{field}: {text!r}")
                continue
            # Cut by max_tokens (these languages never have to end, and the model rarely picks
            # the end token): still a prefix of an output, which one of a few short
            # completions makes whole.
            self.assertTrue(any(check(text + tail) for tail in completions or [""]), f"{field}: {text!r}")

    def test_arithmetic(self):
        prompts = [f"Write {k} equations, one a line:\n" for k in ("two", "some", "three", "simple", "short", "easy")]
        tails = [a + ")" * d + b for d in range(8) for a in ("", "1") for b in ("\n", "=1\n")]
        self.run_grammar(ARITHMETIC, prompts, arithmetic_ok, "grammar", completions=tails)

    def test_json(self):
        prompts = [f"Describe {x} as a JSON object." for x in ("a cat", "Paris", "a book", "a car", "a song", "tea")]
        def whole_or_prefix(t):
            # Whole: an object. Cut by max_tokens: one of the closing tails below makes it one.
            try:
                return isinstance(json.loads(t), dict)
            except ValueError:
                return False

        self.run_grammar(JSON_GRAMMAR, prompts, whole_or_prefix, "guided_grammar", max_tokens=160,
                         completions=["", "}", "\"}", "]}", "\"]}", "}}", "\"}}", "1}", "\":1}", "\": 1}", "]}}",
                                      "\"]}}", "}]}", "\"}]}", "null}", ":1}"])

    def test_list(self):
        prompts = [f"Shopping list for {x}:\n" for x in ("a picnic", "breakfast", "a party", "camping", "soup", "cake")]
        self.run_grammar(LIST, prompts, list_ok, "grammar", completions=["", "\n", "x\n", " x\n", "- x\n"])

    def test_structured_outputs_grammar(self):
        text, finish = complete("Answer yes or no:", structured_outputs={"grammar": 'root ::= ("yes" | "no") "."\n'})
        self.assertIn(text, ("yes.", "no."))
        self.assertEqual(finish, "stop")


# Schemas with every keyword the constraint enforces besides structure.
SCHEMAS = [
    {"type": "object", "properties": {
        "name": {"type": "string", "minLength": 2, "maxLength": 20, "pattern": "^[A-Z][a-z]+$"},
        "age": {"type": "integer", "minimum": 18, "maximum": 99}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {
        "score": {"type": "number", "minimum": 0, "maximum": 10},
        "rank": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 6}},
     "required": ["score", "rank"]},
    {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12, "pattern": "^[a-z]+$"},
                 "minItems": 2, "maxItems": 4}},
     "required": ["tags"]},
    {"type": "object", "properties": {
        "zip": {"type": "string", "pattern": "^\\d{5}$"},
        "temperature": {"type": "integer", "minimum": -40, "maximum": 50},
        "code": {"type": "string", "pattern": "[A-Z]{2}", "maxLength": 8}},
     "required": ["zip", "temperature", "code"]},
    {"type": "object", "properties": {
        "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
        "rating": {"type": "number", "minimum": -5, "maximum": 5},
        "words": {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9},
                  "minItems": 1, "maxItems": 3}},
     "required": ["year", "rating", "words"]},
]
SUBJECTS = ["Alice", "a robot", "Tokyo", "a film", "my cat", "the weather", "a song", "Bob", "a shop", "a car"]


class SchemaKeywords(unittest.TestCase):
    def test_fifty_prompts_validate(self):
        cases = [(f"Describe {SUBJECTS[i % 10]} as JSON.", SCHEMAS[i % 5]) for i in range(50)]

        def run(item):
            i, (prompt, schema) = item
            if i % 3 == 0:
                r = client().chat.completions.create(
                    model=MODEL, max_tokens=200, temperature=0,
                    messages=[{"role": "user", "content": prompt}],
                    response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
                return schema, r.choices[0].message.content, r.choices[0].finish_reason
            if i % 3 == 1:
                text, finish = chat(prompt, max_tokens=200, temperature=0.9, seed=i, guided_json=schema)
                return schema, text, finish
            text, finish = complete(prompt + "\n", max_tokens=200, guided_json=schema)
            return schema, text, finish

        for schema, text, finish in parallel(run, list(enumerate(cases))):
            self.assertEqual(finish, "stop", text)
            jsonschema.validate(json.loads(text), schema)


class Errors(unittest.TestCase):
    def expect_400(self, path, param, message_start, **extra):
        body = dict(model=MODEL, max_tokens=4, **extra)
        if path == "/v1/chat/completions":
            body["messages"] = [{"role": "user", "content": "hi"}]
        else:
            body["prompt"] = "hi"
        r = httpx.post(SERVER.url + path, json=body, timeout=60)
        self.assertEqual(r.status_code, 400, r.text)
        err = r.json()["error"]
        self.assertEqual(err["param"], param, err["message"])
        self.assertTrue(err["message"].startswith(message_start), err["message"])

    def test_bad_constraints_are_a_400_naming_the_field(self):
        c, ch = "/v1/completions", "/v1/chat/completions"
        self.expect_400(c, "guided_regex", "guided_regex: position 1: missing ')'", guided_regex="a(b")
        self.expect_400(ch, "grammar", "grammar: 1:10: undefined rule 'foo'", grammar="root ::= foo\n")
        self.expect_400(c, "guided_grammar", "guided_grammar: 2:3: expected '::='",
                        guided_grammar='root ::= "a"\nx = "b"\n')
        self.expect_400(c, "structured_outputs.regex", "structured_outputs.regex: position 0: nothing to repeat",
                        structured_outputs={"regex": "*"})
        self.expect_400(ch, "guided_choice", "guided_choice: cannot be combined with guided_regex",
                        guided_regex="a", guided_choice=["a"])
        self.expect_400(c, "guided_choice", "guided_choice: expected a non-empty list", guided_choice=[])
        self.expect_400(c, "guided_choice[1]", "guided_choice[1]: expected a string", guided_choice=["a", 3])
        self.expect_400(ch, "guided_regex", "guided_regex: cannot be combined with response_format",
                        guided_regex="a", response_format={"type": "json_object"})
        self.expect_400(c, "structured_outputs.xml", "structured_outputs.xml: is not supported",
                        structured_outputs={"xml": "<a/>"})
        self.expect_400(c, "guided_json.properties.x.pattern", "guided_json.properties.x.pattern: position 0",
                        guided_json={"type": "object", "properties": {"x": {"type": "string", "pattern": "(?<n>a)"}}})
        self.expect_400(ch, "response_format.json_schema.schema.properties.p.exclusiveMinimum",
                        "response_format.json_schema.schema.properties.p.exclusiveMinimum: is not enforced exactly",
                        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
                            "type": "object", "properties": {"p": {"type": "number", "exclusiveMinimum": 0}}}}})
        text, finish = complete("hi", max_tokens=4)
        self.assertTrue(finish in ("stop", "length"))


if __name__ == "__main__":
    sys.exit(h.run_tests([Errors, Regex, Grammar, SchemaKeywords]))
