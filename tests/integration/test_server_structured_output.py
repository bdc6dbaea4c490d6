"""Structured output and tool calls on `tessera serve` (issue 16), with the real clients:

- the openai client's `response_format: json_schema` on 50 varied prompts (half greedy and
  whole, half sampled with temperature/top_p/seed and streamed): every answer parses and
  validates against its schema (the `jsonschema` package), finish_reason "stop";
- `json_object` mode; a seeded constrained request is reproducible;
- the openai client's `tools` on 52 prompts (required, a named function, auto; whole and
  streamed): every call parses, names a given tool and its arguments validate against that
  tool's parameters; finish_reason "tool_calls"; streamed `delta.tool_calls` in the OpenAI
  shape (index, id, type, function.name first, then argument fragments);
- assistant `tool_calls` and `role: "tool"` messages in the prompt;
- LangChain (`langchain-openai`): `with_structured_output` with a Pydantic model in both its
  json_schema and function_calling modes, and a `bind_tools` round trip (tool call -> tool
  message -> final answer);
- bad schemas and tools are a 400 naming the field, and the server goes on serving.
"""
import concurrent.futures as cf
import json
import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(__file__))
import server_harness as h  # noqa: E402

h.require_environment(modules=("openai", "httpx", "jsonschema", "langchain_openai", "pydantic"))
import httpx  # noqa: E402
import jsonschema  # noqa: E402

SERVER = None
MODEL = None
WORKERS = 8  # concurrent requests: the engine batches them


def setUpModule():
    global SERVER, MODEL
    SERVER = h.Server("max_queued_requests: 128", name="structured").start()
    MODEL = client().models.list().data[0].id


def tearDownModule():
    SERVER.stop_and_check()


def client():
    return SERVER.openai_client(api_key="unused", timeout=300)


def parallel(fn, items):
    with cf.ThreadPoolExecutor(WORKERS) as pool:
        return list(pool.map(fn, items))


# Bounded strings and arrays: every output is complete well within max_tokens.
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 30}, "age": {"type": "integer"},
    "city": {"type": "string", "maxLength": 30}},
    "required": ["name", "age", "city"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 30}, "temperature": {"type": "number"},
    "condition": {"enum": ["sunny", "cloudy", "rainy", "snowy"]}},
    "required": ["city", "temperature", "condition"], "additionalProperties": False}
BOOK = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 40}, "author": {"type": "string", "maxLength": 30},
    "year": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3}},
    "required": ["title", "author"]}
ADDRESS = {"$defs": {"Address": {"type": "object", "properties": {
    "street": {"type": "string", "maxLength": 30}, "city": {"type": "string", "maxLength": 30}},
    "required": ["street", "city"]}},
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                     "address": {"$ref": "#/$defs/Address"}},
    "required": ["name", "address"]}
SENTIMENT = {"type": "object", "properties": {
    "sentiment": {"enum": ["positive", "negative", "neutral"]},
    "confidence": {"type": "number"},
    "note": {"anyOf": [{"type": "string", "maxLength": 40}, {"type": "null"}]}},
    "required": ["sentiment", "confidence", "note"]}

NAMES = ["Alice", "Bob", "Chen", "Dana", "Emeka", "Fatima", "Goran", "Hiro", "Ines", "Jonas"]
CITIES = ["Paris", "Lagos", "Osaka", "Lima", "Oslo", "Cairo", "Denver", "Pune", "Porto", "Hanoi"]
TOPICS = ["a rainy day", "my new phone", "the train being late", "a great concert", "burnt toast"]


def schema_cases():
    cases = []
    for i in range(10):
        cases.append((f"Describe a person named {NAMES[i]} from {CITIES[i]} as JSON.", "person", PERSON))
        cases.append((f"Give today's weather in {CITIES[(i + 3) % 10]} as JSON.", "weather", WEATHER))
        cases.append((f"Recommend a book about {TOPICS[i % 5]} as JSON.", "book", BOOK))
        cases.append((f"Where does {NAMES[(i + 5) % 10]} live? Answer as JSON.", "contact", ADDRESS))
        cases.append((f"Rate the sentiment of: 'I loved {TOPICS[i % 5]}'.", "sentiment", SENTIMENT))
    return cases  # 50


def schema_request(prompt, name, schema, **kw):
    return dict(model=MODEL, max_tokens=200,
                messages=[{"role": "system", "content": "You answer with JSON only."},
                          {"role": "user", "content": prompt}],
                response_format={"type": "json_schema",
                                 "json_schema": {"name": name, "schema": schema, "strict": True}}, **kw)


def streamed_text(**kw):
    text, finish = "", None
    for chunk in client().chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    return text, finish


class JsonSchema(unittest.TestCase):
    def test_fifty_prompts_parse_and_validate(self):
        cases = schema_cases()
        self.assertGreaterEqual(len(cases), 50)

        def run(item):
            i, (prompt, name, schema) = item
            if i % 2 == 0:  # greedy, whole
                r = client().chat.completions.create(**schema_request(prompt, name, schema, temperature=0))
                return prompt, schema, r.choices[0].message.content, r.choices[0].finish_reason
            # sampled (temperature, top_p, seed), streamed
            text, finish = streamed_text(**schema_request(prompt, name, schema, temperature=0.9, top_p=0.95,
                                                          seed=1000 + i))
            return prompt, schema, text, finish

        for prompt, schema, text, finish in parallel(run, list(enumerate(cases))):
            self.assertEqual(finish, "stop", f"{prompt!r}: {text!r}")
            value = json.loads(text)
            jsonschema.validate(value, schema)

    def test_json_object_mode_returns_an_object(self):
        def run(prompt):
            r = client().chat.completions.create(
                model=MODEL, max_tokens=120, temperature=0, response_format={"type": "json_object"},
                messages=[{"role": "user", "content": prompt}])
            return r.choices[0]

        for c in parallel(run, [f"List facts about {city} as JSON." for city in CITIES[:4]]):
            if c.finish_reason == "stop":
                self.assertIsInstance(json.loads(c.message.content), dict)
            else:  # free-form objects are unbounded: cut by max_tokens, still a JSON prefix
                self.assertEqual(c.finish_reason, "length")
                self.assertTrue(c.message.content.startswith("{"))

    def test_a_seeded_sampled_request_is_reproducible(self):
        kw = schema_request("Describe a person named Zoe as JSON.", "person", PERSON, temperature=1.0, seed=42)
        a = client().chat.completions.create(**kw).choices[0].message.content
        b = client().chat.completions.create(**kw).choices[0].message.content
        self.assertEqual(a, b)
        jsonschema.validate(json.loads(a), PERSON)


TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 30},
            "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "Current time in a time zone",
        "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 30}},
                       "required": ["timezone"]}}},
    {"type": "function", "function": {
        "name": "search", "description": "Search the web",
        "parameters": {"type": "object", "properties": {"query": {"type": "string", "maxLength": 60},
                                                        "limit": {"type": "integer"}},
                       "required": ["query"]}}},
]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def tool_cases():
    cases = []
    for i in range(10):
        cases.append((f"What's the weather like in {CITIES[i]}?", "required"))
        cases.append((f"What time is it in {CITIES[(i + 4) % 10]}?", "required"))
        cases.append((f"Search the web for {TOPICS[i % 5]}.", "required"))
        cases.append((f"Is it cold in {CITIES[(i + 7) % 10]} today?",
                      {"type": "function", "function": {"name": "get_weather"}}))
        cases.append((f"Find news about {NAMES[i]}.", "auto"))
    cases.append(("Weather in Rome and the time in Tokyo, please.", "required"))
    cases.append(("Look up the history of chess.", {"type": "function", "function": {"name": "search"}}))
    return cases  # 52


def check_call(test, name, arguments):
    test.assertIn(name, PARAMS)
    jsonschema.validate(json.loads(arguments), PARAMS[name])


class ToolCalls(unittest.TestCase):
    def test_fifty_two_prompts_call_valid_tools(self):
        cases = tool_cases()
        self.assertGreaterEqual(len(cases), 50)

        def run(item):
            i, (prompt, choice) = item
            kw = dict(model=MODEL, max_tokens=160, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False,
                      messages=[{"role": "user", "content": prompt}])
            if i % 2 == 0:
                r = client().chat.completions.create(temperature=0, **kw)
                c = r.choices[0]
                calls = [(t.id, t.type, t.function.name, t.function.arguments) for t in c.message.tool_calls or []]
                return prompt, choice, calls, c.message.content, c.finish_reason
            return (prompt, choice) + stream_tool_calls(self, temperature=0.7, seed=i, **kw)

        for prompt, choice, calls, content, finish in parallel(run, list(enumerate(cases))):
            if choice == "auto" and not calls:
                # Plain text is the model's choice in auto mode, and unconstrained (so it may
                # run to max_tokens); it must not look like a call.
                self.assertIn(finish, ("stop", "length"), prompt)
                self.assertIsInstance(content, str)
                self.assertFalse(content.startswith("<tool_call>"), content)
                continue
            self.assertEqual(finish, "tool_calls", f"{prompt!r}: {content!r}")
            self.assertEqual(len(calls), 1, prompt)  # parallel_tool_calls false
            for call_id, kind, name, arguments in calls:
                self.assertTrue(call_id.startswith("call_"))
                self.assertEqual(kind, "function")
                check_call(self, name, arguments)
                if isinstance(choice, dict):
                    self.assertEqual(name, choice["function"]["name"])

    def test_parallel_calls_each_validate(self):
        r = client().chat.completions.create(
            model=MODEL, max_tokens=240, temperature=0, tools=TOOLS, tool_choice="required",
            messages=[{"role": "user", "content": "Weather in Paris, and the time in Lima."}])
        c = r.choices[0]
        # The model may keep calling until max_tokens ("length"): the complete calls are
        # reported, the cut one is not a call.
        self.assertIn(c.finish_reason, ("tool_calls", "length"))
        self.assertGreaterEqual(len(c.message.tool_calls), 1)
        for t in c.message.tool_calls:
            check_call(self, t.function.name, t.function.arguments)

    def test_tool_results_in_the_conversation(self):
        r = client().chat.completions.create(
            model=MODEL, max_tokens=40, temperature=0, tools=TOOLS, tool_choice="none",
            messages=[{"role": "user", "content": "What's the weather in Oslo?"},
                      {"role": "assistant", "content": None, "tool_calls": [
                          {"id": "call_1", "type": "function",
                           "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
                      {"role": "tool", "tool_call_id": "call_1", "content": "{\"temperature\": -3, \"sky\": \"snow\"}"}])
        c = r.choices[0]
        self.assertIsNone(c.message.tool_calls)
        self.assertTrue(c.message.content)
        self.assertIn(c.finish_reason, ("stop", "length"))


def stream_tool_calls(test, **kw):
    """A streamed chat with tools: checks the delta shape, returns (calls, content, finish)."""
    calls, content, finish = {}, "", None
    for chunk in client().chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            content += c.delta.content or ""
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or []:
                if d.index not in calls:  # the first delta of a call: id, type and name
                    test.assertTrue(d.id and d.id.startswith("call_"))
                    test.assertEqual(d.type, "function")
                    test.assertTrue(d.function.name)
                    calls[d.index] = [d.id, d.type, d.function.name, d.function.arguments or ""]
                else:  # then argument fragments
                    test.assertIsNone(d.id)
                    calls[d.index][3] += d.function.arguments or ""
    test.assertEqual(sorted(calls), list(range(len(calls))))
    return [tuple(calls[k]) for k in sorted(calls)], content or None, finish


class LangChain(unittest.TestCase):
    def llm(self, **kw):
        from langchain_openai import ChatOpenAI
        return ChatOpenAI(model=MODEL, base_url=SERVER.url + "/v1", api_key="unused", temperature=0,
                          max_tokens=200, max_retries=0, timeout=300, **kw)

    def person_model(self):
        from typing import Annotated, Literal

        from pydantic import BaseModel, Field

        class Person(BaseModel):
            """A person."""
            name: str = Field(max_length=30, description="first name")
            age: int
            mood: Literal["happy", "sad", "calm"]
            # Bounded strings: a small model can repeat a word inside an unbounded one until
            # max_tokens.
            hobbies: list[Annotated[str, Field(max_length=20)]] = Field(max_length=3)
        return Person

    def test_with_structured_output_json_schema_and_function_calling(self):
        Person = self.person_model()
        for method in ("json_schema", "function_calling"):
            structured = self.llm().with_structured_output(Person, method=method)
            for who in ("a cheerful baker in Rome", "a retired sailor"):
                p = structured.invoke(f"Invent {who}.")
                self.assertIsInstance(p, Person, method)
                self.assertLessEqual(len(p.name), 30)

    def test_bind_tools_round_trip(self):
        from langchain_core.messages import HumanMessage, ToolMessage
        from langchain_core.tools import tool

        @tool
        def multiply(a: int, b: int) -> int:
            """Multiply two integers."""
            return a * b

        question = HumanMessage("What is 6 times 7? Use the multiply tool.")
        ai = self.llm().bind_tools([multiply], tool_choice="multiply", parallel_tool_calls=False).invoke([question])
        self.assertEqual(len(ai.tool_calls), 1)
        call = ai.tool_calls[0]
        self.assertEqual(call["name"], "multiply")
        self.assertIsInstance(call["args"]["a"], int)
        self.assertIsInstance(call["args"]["b"], int)
        result = multiply.invoke(call["args"])
        final = self.llm().bind_tools([multiply], tool_choice="none").invoke(
            [question, ai, ToolMessage(str(result), tool_call_id=call["id"])])
        self.assertEqual(final.tool_calls, [])
        self.assertIsInstance(final.content, str)
        self.assertTrue(final.content)


class Errors(unittest.TestCase):
    def post(self, body):
        return httpx.post(SERVER.url + "/v1/chat/completions", json=body, timeout=60)

    def expect_400(self, param, **body):
        request = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        request.update(body)
        r = self.post(request)
        self.assertEqual(r.status_code, 400, r.text)
        err = r.json()["error"]
        self.assertEqual(err["type"], "invalid_request_error")
        self.assertEqual(err["param"], param, err["message"])
        self.assertTrue(err["message"].startswith(param + ":"), err["message"])

    def test_bad_input_is_a_400_naming_the_field_and_the_server_goes_on(self):
        js = lambda schema: {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}  # noqa: E731
        self.expect_400("response_format.json_schema.schema.properties.age.type",
                        response_format=js({"type": "object", "properties": {"age": {"type": "int"}}}))
        self.expect_400("response_format.json_schema.schema.$ref", response_format=js({"$ref": "#/$defs/Nope"}))
        self.expect_400("response_format.json_schema.schema", response_format={"type": "json_schema",
                                                                              "json_schema": {"name": "x"}})
        self.expect_400("response_format.type", response_format={"type": "yaml"})
        self.expect_400("tools[0].function.name", tools=[{"type": "function", "function": {"name": "bad name"}}])
        self.expect_400("tools[1].function.parameters.properties.q.type", tools=[
            TOOLS[0], {"type": "function", "function": {"name": "f", "parameters": {
                "type": "object", "properties": {"q": {"type": "strng"}}}}}])
        self.expect_400("tool_choice.function.name", tools=TOOLS,
                        tool_choice={"type": "function", "function": {"name": "missing"}})
        self.expect_400("tool_choice", tool_choice="required")
        self.expect_400("response_format", tools=TOOLS, response_format={"type": "json_object"})
        self.expect_400("messages[1].tool_calls[0].function.arguments", messages=[
            {"role": "user", "content": "hi"},
            {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                  "function": {"name": "f", "arguments": "{not json"}}]}])
        self.expect_400("messages[0].tool_call_id", messages=[{"role": "tool", "content": "42"}])
        r = self.post(dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4))
        self.assertEqual(r.status_code, 200)


if __name__ == "__main__":
    sys.exit(h.run_tests([Errors, JsonSchema, ToolCalls, LangChain]))
