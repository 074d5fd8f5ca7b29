"""A client's bad input gets a clear 4xx naming the field, never a 500 or a misleading message
(``selfrl serve`` and ``selfrl sampler``).

* a grammar built from a client's schema (``tools`` with ``tool_choice`` "required" or a
  named function, ``response_format`` ``json_schema``) that cannot be decoded is refused
  before generation, streamed or not, with a 400 naming ``tools[i].function.parameters`` or
  ``response_format.json_schema.schema``;
* message and content errors say what is wrong and where (``messages[0].content[0].text``);
* NaN and infinities (which Python's json accepts) are "must be a finite number";
* an unexpected exception is a JSON 500 ``server_error``, its traceback in the server log only.

The cases come from a fresh-clone user who tried to break the server; each assert below
failed on the code before this change (the module docstring of each group says how).
"""

from __future__ import annotations

import json
import logging
import re
import threading
import urllib.request

import pytest

from serving import CALC, http, start_uvicorn
from test_constrain import LATE_ENDLESS

URL = "/v1/chat/completions"
USER = [{"role": "user", "content": "What is 6*7?"}]


def chat(url, raw: str | None = None, **body):
    """POST a chat completion (``raw``: the body as JSON text, for NaN literals)."""
    data = raw.encode() if raw is not None else json.dumps(
        {"model": "selfrl", "messages": USER, "max_tokens": 4, "record": False, **body}).encode()
    return http("POST", url + URL, raw=data)


def tool(params, name="f"):
    return {"type": "function", "function": {"name": name, "parameters": params}}


def json_schema(schema):
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def assert_refused(status, body, param, phrase, code="invalid_schema"):
    """Assert an OpenAI-shaped 400 that names ``param`` and says ``phrase``."""
    assert status == 400, body
    err = body["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["code"] == code, err
    assert phrase in err["message"], err["message"]


# -- grammars from client schemas (old code: a 500 "generation failed: ConstraintError ... Too many
# items" for the recursive ones, param "tool_choice" for every tool schema, a lost connection for
# a schema nested 150 deep)

SELF = {"$ref": "#"}
ENDLESS = {"$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}},
           "$ref": "#/$defs/n"}
DEEP = {"type": "string"}
for _ in range(150):
    DEEP = {"type": "array", "items": DEEP}
BAD_SCHEMAS = [  # (schema, what the message says)
    (SELF, "the schema admits no JSON value"),
    (ENDLESS, "the schema has no finite value (it requires itself"),
    ({"type": "nonsense"}, "Invalid type: nonsense"),
    ({"type": "string", "pattern": "("}, "regex parse error"),
    ({"$ref": "#/$defs/nope"}, "Pointer '/$defs/nope' does not exist"),
    ({"type": "array", "minItems": 5, "maxItems": 2}, "minItems (5) is greater than maxItems (2)"),
    ({"type": "string", "minLength": "3"}, "Expected positive integer for 'minLength', got \"3\""),
    ({"type": "string", "enum": [f"v{i}" for i in range(50_000)]}, "schema too large"),
    # schemas that compile to no value at all
    ({"type": "string", "minLength": 5, "maxLength": 2}, "minLength (5) is greater than maxLength (2)"),
    ({"enum": []}, "Unsatisfiable schema: anyOf is empty"),
    ({"type": "integer", "minimum": 5, "maximum": 1}, "minimum (5) is greater than maximum (1)"),
    ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "Unsatisfiable schema: incompatible types"),
    ({"not": {}}, 'Unimplemented keys: ["not"]'),
    ({"type": "object", "properties": {"a": {"enum": []}}, "required": ["a"]}, "required property 'a' is unsatisfiable"),
    # llguidance clamps integer bounds to int64: it would answer 9223372036854775807 here
    ({"type": "integer", "minimum": 10**20, "maximum": 10**20 + 3}, "bounds an integer beyond int64 (minimum = "),
]
IDS = ["self-ref", "endless-ref", "nonsense-type", "bad-regex", "missing-ref", "min-over-max", "number-as-string",
       "huge-enum", "short-over-long", "empty-enum", "low-over-high", "string-and-integer", "not-anything",
       "required-nothing", "beyond-int64"]


@pytest.mark.parametrize("schema, phrase", BAD_SCHEMAS, ids=IDS)
def test_a_tool_schema_that_cannot_be_decoded_is_a_400_naming_the_tool(server, schema, phrase):
    url, _ = server
    for choice in ("required", {"type": "function", "function": {"name": "f"}}):
        status, body = chat(url, tools=[tool(schema)], tool_choice=choice)
        assert_refused(status, body, "tools[0].function.parameters", phrase)
        assert body["error"]["message"].startswith("tools[0].function.parameters (tool 'f'): the schema ")


@pytest.mark.parametrize("schema, phrase", BAD_SCHEMAS, ids=IDS)
def test_a_response_format_schema_that_cannot_be_decoded_is_a_400_naming_it(server, schema, phrase):
    url, _ = server
    for tools in (None, [CALC]):  # alone, and as the answer beside a tool call (tool_choice "auto")
        status, body = chat(url, response_format=json_schema(schema), tools=tools)
        assert_refused(status, body, "response_format.json_schema.schema", phrase)


@pytest.mark.parametrize("body, param", [
    ({"tools": [tool(LATE_ENDLESS)], "tool_choice": "required"}, "tools"),
    ({"response_format": json_schema(LATE_ENDLESS)}, "response_format"),
], ids=["tool", "response_format"])
def test_a_schema_that_fails_mid_generation_is_a_400_and_the_rest_goes_on(server, body, param):
    """Old code: a 500 "generation failed: ConstraintError ... Too many items" (and, on the
    reference engine, a 500 for every request batched with it)."""
    url, _ = server
    out = {}
    threads = [threading.Thread(target=lambda k=k, b=b: out.__setitem__(k, chat(url, max_tokens=64, **b)))
               for k, b in (("bad", body), ("plain", {}))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert_refused(*out["bad"], param, f"{param}: the schema failed during generation: ")
    assert "Too many items" in out["bad"][1]["error"]["message"]
    assert out["plain"][0] == 200, out["plain"]
    status, body = chat(url)
    assert status == 200 and body["choices"][0]["message"]["role"] == "assistant"  # the server goes on


@pytest.mark.parametrize("text, param", [("<tool_call>{\"name\": \"f\", \"arg", "tools"), ('{"a": "xy', "response_format")])
def test_where_a_call_or_an_answer_was_allowed_the_error_names_the_one_begun(tiny_tokenizer, text, param):
    from selfrl.chat.constrain import Constraint, ConstraintError
    from selfrl.engines.base import Generation
    from selfrl.serve.batcher import Job, _grammar_failed
    from selfrl.serve.disconnect import generation_failed

    ids = tiny_tokenizer.encode(text)
    job = Job([1, 2], 8, 1.0, 1.0, False, None, (), None, constraint=Constraint("tool_call_or_json", "start: x"))
    e = _grammar_failed(Generation(ids, [0.0] * len(ids), False, 0, grammar_error="Too many items"), job,
                        tiny_tokenizer)
    assert isinstance(e, ConstraintError) and e.param == param
    err = generation_failed([job], e)
    assert (err.status, err.param, err.code) == (400, param, "invalid_schema") and job.cancel.is_set()


def test_a_schema_that_fails_mid_stream_ends_the_stream_with_an_error_naming_it(server):
    """Old code: the error event of a started stream had no ``param`` (and was a 500's)."""
    url, _ = server
    data = json.dumps({"model": "selfrl", "messages": USER, "max_tokens": 64, "record": False, "stream": True,
                       "response_format": json_schema(LATE_ENDLESS)}).encode()
    req = urllib.request.Request(url + URL, data=data, method="POST", headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as f:
        assert f.status == 200
        events = [line[len(b"data: "):] for line in f.read().splitlines() if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]" and len(events) > 2  # tokens were streamed before the grammar failed
    err = json.loads(events[-2])["error"]
    assert err["code"] == "invalid_schema" and err["param"] == "response_format", err
    assert err["message"].startswith("response_format: the schema failed during generation: ")


def test_the_tool_at_fault_is_named_among_several(server):
    url, _ = server
    status, body = chat(url, tools=[CALC, tool(SELF, "g")], tool_choice="required")
    assert_refused(status, body, "tools[1].function.parameters", "tools[1].function.parameters (tool 'g')")


def test_a_streaming_request_gets_the_400_before_its_stream_starts(server):
    url, _ = server
    data = json.dumps({"model": "selfrl", "messages": USER, "max_tokens": 4, "record": False, "stream": True,
                       "tools": [tool(SELF)], "tool_choice": "required"}).encode()
    req = urllib.request.Request(url + URL, data=data, method="POST", headers={"content-type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=60)
    assert e.value.code == 400 and e.value.headers["content-type"] == "application/json"
    assert_refused(400, json.loads(e.value.read()), "tools[0].function.parameters", "admits no JSON value")


@pytest.mark.parametrize("where, body, param", [
    ("tools", {"tools": [tool(DEEP)], "tool_choice": "required"}, "tools[0].function.parameters"),
    ("response_format", {"response_format": json_schema(DEEP)}, "response_format.json_schema.schema"),
])
def test_a_schema_nested_too_deep_is_a_400_naming_its_field(server, where, body, param):
    url, _ = server
    status, out = chat(url, **body)
    assert_refused(status, out, param, "nests objects and arrays more than 100 deep", code=None)


@pytest.mark.parametrize("rf, param, phrase", [
    (json_schema([1, 2]), "response_format.json_schema.schema", "must be a JSON schema object, got an array"),
    ({"type": "json_schema", "json_schema": "x"}, "response_format.json_schema", "got a string"),
    ({"type": "xml"}, "response_format.type", "got type 'xml'"),
])
def test_a_response_format_of_the_wrong_shape_names_the_part(server, rf, param, phrase):
    url, _ = server
    assert_refused(*chat(url, response_format=rf), param, phrase, code=None)


TREE = {"type": "object", "properties": {"v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#"}}},
        "required": ["v"]}
PYDANTIC = {"$defs": {"City": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}},
                               "required": ["name"]}},
            "type": "object", "properties": {"city": {"$ref": "#/$defs/City"}}, "required": ["city"]}
NESTED = {"type": "boolean"}
for _ in range(12):
    NESTED = {"type": "object", "properties": {"a": NESTED}, "required": ["a"]}


def _depth_of_a(args) -> int:
    depth = 0
    while isinstance(args, dict):
        assert set(args) == {"a"}
        args, depth = args["a"], depth + 1
    assert isinstance(args, bool)
    return depth


@pytest.mark.parametrize("schema, check", [
    (TREE, None),  # may recurse past the token limit: served, valid as far as it goes
    (PYDANTIC, lambda args: set(args) == {"city"} and set(args["city"]) == {"name"} and len(args["city"]["name"]) <= 8),
    (NESTED, lambda args: _depth_of_a(args) == 12),  # twelve objects, one in another, around a boolean
], ids=["recursive-tree", "pydantic-defs", "nested-12"])
def test_schemas_that_can_be_decoded_are_served_and_their_refs_are_the_tools_own(server, schema, check):
    """A tool's ``$ref`` resolves within its own parameters: ``#`` is the parameters, not the
    call around them (old code: ``#/$defs/City`` was a 400 "Pointer does not exist")."""
    url, _ = server
    status, body = chat(url, tools=[tool(schema)], tool_choice="required", max_tokens=200, temperature=0)
    assert status == 200, body
    choice = body["choices"][0]
    if check is not None:  # bounded: the call always fits in 200 tokens
        assert choice["finish_reason"] == "tool_calls", choice
        assert check(json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]))
    status, body = chat(url, response_format=json_schema(schema), max_tokens=200, temperature=0)
    assert status == 200, body


# -- messages and content (old code: "only text content parts are supported, got type 'text'" for a
# text part without "text", param "messages" or "messages.0.content.str")

@pytest.mark.parametrize("messages, param, phrase", [
    ([{"role": "user", "content": [{"type": "text"}]}], "messages[0].content[0].text",
     'a "text" content part needs a "text" string; this one has no "text" key'),
    ([{"role": "user", "content": [{"type": "text", "text": 5}]}], "messages[0].content[0].text",
     '"text" must be a string, got a number'),
    ([{"role": "user", "content": ["hi"]}], "messages[0].content[0]",
     "a content part must be an object"),
    ([{"role": "user", "content": [{"text": "hi"}]}], "messages[0].content[0].type",
     'a content part needs a "type"'),
    ([{"role": "user", "content": 5}], "messages[0].content",
     "content must be a string, an array of content parts or null, got a number"),
    ([{"role": "user", "content": None}], "messages[0].content",
     "content of a 'user' message must not be null"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}],
     "messages[0].content[0].type", "only text content parts are supported, got type 'image_url'"),
    ([*USER, {"role": "tool", "content": "42"}], "messages[1].tool_call_id",
     "the tool message has no tool_call_id"),
    ([*USER, {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
        "name": "calculator", "arguments": "{not json"}}]}, {"role": "tool", "tool_call_id": "c1", "content": "4"}],
     "messages[1].tool_calls[0].function.arguments", "arguments must be a JSON object encoded as a string; this is "
     "not JSON"),
    ([*USER, {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
        "name": "calculator", "arguments": "[1]"}}]}, {"role": "tool", "tool_call_id": "c1", "content": "4"}],
     "messages[1].tool_calls[0].function.arguments", "got an array"),
    ([{"role": "wizard", "content": "hi"}], "messages[0].role", "Input should be 'system', 'developer'"),
    ([{"role": "user", "content": "hi", "name": 5}], "messages[0].name", "messages[0].name must be a string, got the number 5"),
])
def test_a_bad_message_is_a_400_that_says_what_is_wrong_and_where(server, messages, param, phrase):
    url, _ = server
    status, body = chat(url, messages=messages)
    assert_refused(status, body, param, phrase, code=None)
    assert "got type 'text'" not in body["error"]["message"]


# -- numbers (old code: NaN and Infinity got the bound's message, "less than or equal to 2", or
# "presence_penalty is not supported"; a seed of 2**70 was accepted)

NUMERIC = ["temperature", "top_p", "presence_penalty", "frequency_penalty", "max_tokens", "max_completion_tokens",
           "n", "seed", "top_logprobs"]


@pytest.mark.parametrize("literal, shown", [("NaN", "nan"), ("Infinity", "inf"), ("-Infinity", "-inf"),
                                            ("1e400", "inf")])
@pytest.mark.parametrize("field", NUMERIC)
def test_nan_and_infinity_are_not_finite_numbers(server, field, literal, shown):
    url, _ = server
    raw = f'{{"model": "selfrl", "messages": [{{"role": "user", "content": "hi"}}], "{field}": {literal}}}'
    status, body = chat(url, raw=raw)
    assert_refused(status, body, field, f"{field} must be a finite number, got {shown}", code=None)


def test_logit_bias_values_and_seed_are_checked(server):
    url, _ = server
    raw = '{"model": "selfrl", "messages": [{"role": "user", "content": "hi"}], "logit_bias": {"5": NaN}}'
    assert_refused(*chat(url, raw=raw), "logit_bias.5", "logit_bias['5'] must be a finite number, got nan", code=None)
    assert_refused(*chat(url, seed=2**70), "seed", "less than or equal to 9223372036854775807", code=None)
    assert_refused(*chat(url, temperature="NaN"), "temperature", "temperature must be a finite number, got 'NaN'", code=None)
    status, body = chat(url, seed=2**62, temperature=0.5)  # in range: accepted (and ignored)
    assert status == 200, body


def test_the_responses_api_names_finite_numbers_and_content_parts_too(server):
    url, _ = server
    raw = '{"model": "selfrl", "input": "hi", "temperature": NaN}'
    status, body = http("POST", url + "/v1/responses", raw=raw.encode())
    assert_refused(status, body, "temperature", "temperature must be a finite number, got nan", code=None)
    status, body = http("POST", url + "/v1/responses", {"model": "selfrl", "input": [
        {"role": "user", "content": [{"type": "input_text"}]}]})
    assert_refused(status, body, "input.0", 'content[0]: a input_text part needs a "text" string; this one has no "text" '
            "key", code=None)


@pytest.mark.parametrize("extra, param, phrase", [  # old code: a plain-text 500 (KeyError, AttributeError)
    ({"tools": [{"type": "function"}]}, "tools.0", "a function tool needs a 'name' string; this one has none"),
    ({"input": [{"type": "function_call_output", "output": "4"}]}, "input.0",
     "a function_call_output item needs a 'call_id' string"),
    ({"text": {"format": "json"}}, "text.format", "text.format must be an object"),
    ({"input": [5]}, "input[0]", "an input item must be an object (a message, function_call or "
     "function_call_output), got a number"),
    ({"input": {"role": "user"}}, "input", "input must be a string or an array of input items, got an object"),
    # the chat completion's checks, named as the Responses request's own fields
    ({"tools": [{"type": "function", "name": "f", "parameters": SELF}], "tool_choice": "required"},
     "tools[0].parameters", "the schema admits no JSON value"),
    ({"text": {"format": {"type": "json_schema", "name": "a", "schema": ENDLESS}}}, "text.format.schema",
     "the schema has no finite value"),
])
def test_the_responses_api_refuses_malformed_items_by_name(server, extra, param, phrase):
    url, _ = server
    status, body = http("POST", url + "/v1/responses", {"model": "selfrl", "input": "hi", "max_output_tokens": 4,
                                                        **extra})
    assert status == 400 and body["error"]["param"] == param and phrase in body["error"]["message"], body


@pytest.mark.parametrize("path, body, param", [  # old code: param "max_tokens" whatever the field
    (URL, {"max_tokens": 10**9}, "max_tokens"),
    (URL, {"max_tokens": None, "max_completion_tokens": 10**9}, "max_completion_tokens"),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 10**9}, "max_output_tokens"),
])
def test_a_token_limit_beyond_the_context_is_a_400_naming_the_field_set(server, path, body, param):
    url, _ = server
    full = {"model": "selfrl", "record": False, **({"messages": USER, "max_tokens": 4} if path == URL else {}), **body}
    status, out = http("POST", url + path, full)
    assert_refused(status, out, param, f"{param} 1000000000 + prompt ", code="context_length_exceeded")
    message = out["error"]["message"]  # the tiny model's context; the prompt's count (a lower bound) in good English
    assert re.search(r"\+ prompt (at least )?(1 token|\d+ tokens) exceeds the context of 8192 tokens$", message), message


def test_a_body_nested_too_deep_to_parse_is_a_400_that_says_so(server):
    url, _ = server
    raw = '{"model": "selfrl", "messages": [{"role": "user", "content": "hi"}], "metadata": ' + "[" * 5000 + \
        "]" * 5000 + "}"
    status, body = chat(url, raw=raw)
    assert status == 400 and body["error"]["code"] == "body_too_deep"
    assert body["error"]["message"] == "the body nests objects and arrays too deeply to parse"


# -- an unexpected exception (old code: a plain-text "Internal Server Error")


def test_an_unexpected_exception_is_a_json_500_with_its_class_and_no_traceback(server, monkeypatch, caplog):
    url, service = server

    def broken(*_a, **_k):
        raise KeyError("injected failure")

    monkeypatch.setattr(service.turns, "check_model_name", broken)
    with caplog.at_level(logging.ERROR, logger="selfrl.serve"):
        status, body = chat(url)
    assert status == 500
    assert body == {"error": {"message": "internal server error: KeyError: 'injected failure'",
                              "type": "server_error", "param": None, "code": "internal_error"}}
    logged = [r for r in caplog.records if r.name == "selfrl.serve" and r.exc_info]
    assert logged and "POST /v1/chat/completions failed" in logged[0].getMessage()
    monkeypatch.undo()
    assert chat(url)[0] == 200  # and it keeps serving


# -- selfrl sampler (old code: NaN crashed the validation error handler, no answer at all; Infinity was
# sampled at an infinite temperature, uniformly; validation errors were 422s with a list)


@pytest.fixture(scope="module")
def sampler(tiny_tokenizer, tiny_model_factory):
    from selfrl.engines.reference import Engine
    from selfrl.serve.sampler_app import create_sampler_app

    model = tiny_model_factory(lora=True, eos_bias=3.0)
    model.config.max_position_embeddings = 1024  # a short context, so that "exactly the context" is cheap to sample
    engine = Engine(model, tiny_tokenizer)
    url, srv, thread = start_uvicorn(create_sampler_app(engine))
    yield url, engine
    srv.should_exit = True
    thread.join(timeout=60)


@pytest.mark.parametrize("path, field, literal", [
    ("/sampler/generate", "temperature", "NaN"), ("/sampler/generate", "temperature", "Infinity"),
    ("/sampler/generate", "top_p", "NaN"), ("/sampler/generate", "max_new_tokens", "NaN"),
    ("/sampler/generate", "max_new_tokens", "-Infinity"),
    ("/sampler/logprobs", "temperature", "NaN"), ("/sampler/logprobs", "temperature", "Infinity"),
])
def test_the_sampler_refuses_nan_and_infinity_naming_the_field(sampler, path, field, literal):
    url, _ = sampler
    body = {"prompts": [[1, 2, 3]], "max_new_tokens": 4} if path.endswith("generate") else {"token_ids": [1, 2, 3]}
    raw = json.dumps({**body, field: "__X__"}).replace('"__X__"', literal)
    status, out = http("POST", url + path, raw=raw.encode())
    shown = {"NaN": "nan", "Infinity": "inf", "-Infinity": "-inf"}[literal]
    assert status == 400 and out == {"detail": f"{field} must be a finite number, got {shown} (at {field})"}


def test_the_sampler_refuses_a_token_limit_beyond_the_context_as_serve_does(sampler):
    """Old code: ``max_new_tokens`` 10**9 was sampled (a model that never ends a turn ran on
    past its context, for as long as memory lasted)."""
    url, _ = sampler
    status, out = http("POST", url + "/sampler/generate", {"prompts": [[1, 2]], "max_new_tokens": 10**9})
    assert status == 400 and out == {"detail": "max_new_tokens 1000000000 + prompt 2 tokens exceeds the context of "
                                               "1024 tokens (at max_new_tokens)"}
    status, out = http("POST", url + "/sampler/generate", {"prompts": [[1, 2], [3] * 1024], "max_new_tokens": 2})
    assert status == 400 and out == {"detail": "the prompt is 1024 tokens; this model's context is 1024 tokens "
                                               "(at prompts[1])"}
    status, out = http("POST", url + "/sampler/generate", {"prompts": [[1, 2]], "max_new_tokens": 1022})
    assert status == 200 and len(out["generations"]) == 1  # exactly the context: served
    # the swap check's probe: old code scored 5000 ids against a 1024-position model (a model with
    # learned positions would fail with a 500)
    status, out = http("POST", url + "/sampler/logprobs", {"token_ids": [3] * 1025})
    assert status == 400 and out == {"detail": "token_ids holds 1025 tokens; this model's context is 1024 tokens "
                                               "(at token_ids)"}
    status, out = http("POST", url + "/sampler/logprobs", {"token_ids": [3] * 1024})
    assert status == 200 and len(out["logprobs"]) == 1023  # each id after the first, given its prefix


def test_the_sampler_names_a_field_of_the_wrong_type_and_an_empty_stop(sampler):
    url, _ = sampler
    status, out = http("POST", url + "/sampler/generate", {"prompts": "abc", "max_new_tokens": 4})
    assert status == 400 and out == {"detail": 'prompts must be an array, got the string "abc"'}
    status, out = http("POST", url + "/sampler/generate", {"prompts": [[1, 2]], "max_new_tokens": 4, "stop": [""]})
    assert status == 400 and "stop strings must be non-empty" in out["detail"]


def test_the_sampler_answers_an_unexpected_exception_with_a_json_500(sampler, monkeypatch):
    url, engine = sampler

    def broken(*_a, **_k):
        raise RuntimeError("injected sampler failure")

    monkeypatch.setattr(engine, "generate", broken)
    status, out = http("POST", url + "/sampler/generate", {"prompts": [[1, 2]], "max_new_tokens": 2})
    assert status == 500 and out == {"error": {"message": "internal server error: RuntimeError: injected sampler "
                                               "failure", "type": "server_error", "param": None,
                                               "code": "internal_error"}}
    monkeypatch.undo()
    status, out = http("POST", url + "/sampler/generate", {"prompts": [[1, 2]], "max_new_tokens": 2})
    assert status == 200 and len(out["generations"]) == 1


def test_a_request_beyond_a_sliding_window_the_engine_cannot_apply_is_a_400(tmp_path, tiny_tokenizer):
    # the slot engine's masks have no sliding window: it serves prompt + max_tokens up to window + 1,
    # and the server refuses more as any context overflow (it answered 500, which clients retry)
    from serving import API_KEY, running_server, serve_config
    from transformers import MistralConfig, MistralForCausalLM

    from selfrl.testing import add_lora

    cfg = MistralConfig(vocab_size=len(tiny_tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, sliding_window=64,
                        eos_token_id=tiny_tokenizer.eos_token_id, pad_token_id=tiny_tokenizer.eos_token_id)
    cfg._attn_implementation = "sdpa"
    model = add_lora(MistralForCausalLM(cfg).eval(), seed=1)
    with running_server(model, tiny_tokenizer, serve_config(tmp_path, "slots")) as (url, service):
        assert service.context == 65
        long = [{"role": "user", "content": "Add up all of these numbers for me please: " + " ".join(map(str, range(40)))}]
        status, out = http("POST", url + URL, {"model": "selfrl", "messages": long, "max_tokens": 4}, key=API_KEY)
        assert status == 400 and out["error"]["code"] == "context_length_exceeded", out
        assert "context is 65 tokens" in out["error"]["message"]
        status, out = http("POST", url + URL, {"model": "selfrl", "messages": USER}, key=API_KEY)  # no limit set
        assert status == 200 and out["usage"]["prompt_tokens"] + out["usage"]["completion_tokens"] <= 65, out
