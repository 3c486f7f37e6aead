"""What the OpenAI server does with a request's fields: tools, logit_bias,
streamed logprobs, and every refusal, driven by the official ``openai`` client.

One ``tracevllm serve`` process on the tiny model serves the module (its
stderr kept, to read what it logged). The tool calls are generated with
``disable_any_whitespace``: a random-weight model would otherwise pad the
JSON with whitespace up to max_tokens.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.test_serving import API_KEY, MESSAGES, Server, greedy
from tracevllm.tool_parsers.streaming import (
    RequiredToolCallScanner,
    extract_required_tool_call_streaming,
)

pytestmark = pytest.mark.timeout(180)

WEATHER = {
    "type": "object",
    "properties": {"unit": {"enum": ["c", "f"]}, "rain": {"type": "boolean"}},
    "required": ["unit", "rain"],
    "additionalProperties": False,
}
CLOCK = {
    "type": "object",
    "properties": {"utc": {"type": "boolean"}},
    "required": ["utc"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": CLOCK}},
]  # fmt: skip
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}
# A stop string that never matches: the detokenizer holds back its length
# minus one characters, so the first tokens' text deltas are empty.
NEVER = "zzzzzzzzzzzzzzzzzzzzzzzz"
# (On the tiny model, greedy, this one's "required" reply closes its array.)
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("serve") / "stderr.log"
    with log.open("wb") as stderr:
        s = Server(tiny_model_dir, "--trust-request-chat-template", stderr=stderr)
        s.log = log  # type: ignore[attr-defined]
        yield s
        assert s.stop() == 0


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return server.client()


def post(server: Server, path: str, body: bytes | dict[str, Any]) -> httpx.Response:
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{server.url}/v1/{path}", content=content, headers=headers, timeout=60)


# --- streamed logprobs --------------------------------------------------------------
def test_streamed_completion_logprobs_cover_held_back_tokens(client: openai.OpenAI) -> None:
    """A token whose text is held back (here by a possible stop string) comes
    in a chunk with empty text, and its logprobs with it (issue 22, item 4)."""
    kw = greedy(prompt="Once upon a time", max_tokens=12, logprobs=2, stop=[NEVER],
                extra_body={"ignore_eos": True})  # fmt: skip
    whole = client.completions.create(**kw).choices[0].logprobs
    tokens, logprobs, empty_chunks, text = [], [], 0, ""
    for chunk in client.completions.create(stream=True, **kw):
        choice = chunk.choices[0]
        empty_chunks += choice.text == ""
        if choice.logprobs is not None:
            tokens += choice.logprobs.tokens
            logprobs += choice.logprobs.token_logprobs
            # A chunk's offsets start at the text streamed before it (vLLM's).
            assert choice.logprobs.text_offset[0] == len(text)
        text += choice.text
    assert empty_chunks >= 1  # the case under test happened
    assert tokens == whole.tokens and len(tokens) == 12
    assert logprobs == pytest.approx(whole.token_logprobs)


def test_streamed_chat_logprobs_cover_held_back_tokens(client: openai.OpenAI) -> None:
    kw = greedy(messages=MESSAGES, max_tokens=12, logprobs=True, top_logprobs=2, stop=[NEVER],
                extra_body={"ignore_eos": True})  # fmt: skip
    whole = client.chat.completions.create(**kw).choices[0].logprobs.content
    streamed, empty_chunks = [], 0
    for chunk in client.chat.completions.create(stream=True, **kw):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            empty_chunks += not chunk.choices[0].delta.content
            streamed += chunk.choices[0].logprobs.content
    assert empty_chunks >= 1
    assert [p.token for p in streamed] == [p.token for p in whole] and len(streamed) == 12
    assert [p.logprob for p in streamed] == pytest.approx([p.logprob for p in whole])


def test_an_engine_error_is_raised_before_its_chunk_is_sent() -> None:
    """vLLM's order: an output that finishes with "error" is not sent as a
    chunk (finish_reason "error"); the stream's next event is the error
    object. The handlers' stream generators, fed the outputs a request that
    fails after one token would bring (no engine can be made to fail so on
    purpose)."""
    import asyncio

    from tracevllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from tracevllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from tracevllm.entrypoints.openai.completion.protocol import CompletionRequest
    from tracevllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
    from tracevllm.outputs import CompletionOutput, RequestOutput

    def outputs() -> list[RequestOutput]:
        def output(text: str, ids: list[int], finish: str | None) -> RequestOutput:
            completion = CompletionOutput(0, text, ids, None, None, finish_reason=finish)
            return RequestOutput("r", "p", [1], [completion], finished=finish is not None)

        return [output("Hello", [5], None), output("", [6], "error")]

    async def events(stream: Any) -> list[dict[str, Any] | str]:
        got: list[dict[str, Any] | str] = []
        async for event in stream:
            data = event.removeprefix("data: ").strip()
            got.append(data if data == "[DONE]" else json.loads(data))
        return got

    async def each(items: list[Any]) -> Any:
        for item in items:
            yield item

    completion = OpenAIServingCompletion.__new__(OpenAIServingCompletion)
    got = asyncio.run(events(completion.completion_stream_generator(
        CompletionRequest(prompt="p", stream=True), [{"prompt": "p", "prompt_token_ids": [1]}],
        each([(0, out) for out in outputs()]), "cmpl-r", "m")))  # fmt: skip
    assert [e["choices"][0]["text"] for e in got[:-2]] == ["Hello"], got  # type: ignore[index]
    assert got[-2]["error"]["code"] == 500 and got[-1] == "[DONE]", got  # type: ignore[index]
    chat = OpenAIServingChat.__new__(OpenAIServingChat)
    got = asyncio.run(events(chat.chat_completion_stream_generator(
        ChatCompletionRequest(messages=MESSAGES, stream=True), each(outputs()), "chatcmpl-r",
        "m", 1)))  # fmt: skip
    deltas = [e["choices"][0]["delta"] for e in got[:-2]]  # type: ignore[index]
    assert deltas == [{"role": "assistant", "content": ""}, {"content": "Hello"}], got
    assert got[-2]["error"]["code"] == 500 and got[-1] == "[DONE]", got  # type: ignore[index]


# --- logit_bias ---------------------------------------------------------------------
def test_logit_bias_changes_the_output(server: Server, client: openai.OpenAI) -> None:
    kw = greedy(prompt="The capital of France is", max_tokens=4, extra_body={"ignore_eos": True})
    plain = client.completions.create(**kw).choices[0].text
    token = httpx.post(f"{server.url}/tokenize", json={"prompt": " Paris"}).json()["tokens"][-1]
    forced = client.completions.create(logit_bias={str(token): 100}, **kw).choices[0]
    assert forced.text == " Paris" * 4 != plain
    chat = client.chat.completions.create(
        messages=MESSAGES, logit_bias={str(token): 100}, **greedy(max_tokens=3, extra_body={
            "ignore_eos": True}))  # fmt: skip
    assert chat.choices[0].message.content == " Paris" * 3


@pytest.mark.parametrize(
    ("bias", "words"),
    [({"a": 1}, "token ids"), ({"1.5": 1}, "token ids"), ({"5": 101}, "[-100, 100]"),
     ({"5": -100.5}, "[-100, 100]"), ({"999999": 1}, "out-of-vocab"), ({"-1": 1}, "out-of-vocab")],
)  # fmt: skip
def test_logit_bias_refusals_name_it(
    client: openai.OpenAI, bias: dict[str, Any], words: str
) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(prompt="x", logit_bias=bias, **greedy(max_tokens=2))
    assert e.value.body["param"] == "logit_bias" and words in e.value.body["message"]


# --- tools --------------------------------------------------------------------------
def _streamed_calls(stream: Any) -> tuple[dict[int, dict[str, Any]], str | None, str]:
    calls: dict[int, dict[str, Any]] = {}
    finish, content = None, ""
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        content += choice.delta.content or ""
        for piece in choice.delta.tool_calls or []:
            call = calls.setdefault(piece.index, {"id": None, "name": None, "arguments": ""})
            if piece.id is not None:
                assert call["id"] is None, "a call is announced once"
                call["id"], call["name"] = piece.id, piece.function.name
            call["arguments"] += piece.function.arguments or ""
    return calls, finish, content


def test_named_tool_choice(client: openai.OpenAI) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    kw = greedy(messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=60,
                extra_body=COMPACT)  # fmt: skip
    out = client.chat.completions.create(**kw).choices[0]
    # A named function's finish reason stays the engine's (OpenAI's, vLLM's).
    assert out.finish_reason == "stop" and out.message.content == ""
    (call,) = out.message.tool_calls
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    calls, finish, content = _streamed_calls(client.chat.completions.create(stream=True, **kw))
    assert finish == "stop" and content == "" and list(calls) == [0]
    assert calls[0]["name"] == "get_weather"
    assert calls[0]["arguments"] == call.function.arguments  # greedy: the same reply


def test_required_tool_choice(client: openai.OpenAI) -> None:
    kw = greedy(messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=200,
                extra_body=COMPACT)  # fmt: skip
    out = client.chat.completions.create(**kw).choices[0]
    assert out.finish_reason == "tool_calls" and out.message.content == ""
    assert out.message.tool_calls
    for call in out.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    calls, finish, content = _streamed_calls(client.chat.completions.create(stream=True, **kw))
    assert finish == "tool_calls" and content == ""
    assert [c["name"] for c in calls.values()] == [c.function.name for c in out.message.tool_calls]
    # Streamed raw, whole re-serialized (vLLM's json.dumps): the same JSON.
    assert [json.loads(c["arguments"]) for c in calls.values()] == [
        json.loads(c.function.arguments) for c in out.message.tool_calls
    ]


def test_tool_choice_none_and_a_tool_result_turn(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        messages=MESSAGES, tools=TOOLS, tool_choice="none", **greedy(max_tokens=4)
    )
    assert out.choices[0].message.content and not out.choices[0].message.tool_calls
    # The conversation goes on after a call: the call and its result, sent back.
    turn = [
        *MESSAGES,
        {"role": "assistant", "tool_calls": [{"id": "call-1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"unit": "c", "rain": false}'}}]},
        {"role": "tool", "tool_call_id": "call-1", "content": "18 degrees, dry"},
    ]  # fmt: skip
    again = client.chat.completions.create(messages=turn, tools=TOOLS, tool_choice="none",
                                           **greedy(max_tokens=4))  # fmt: skip
    assert again.choices[0].message.content


@pytest.mark.parametrize(
    ("kw", "param", "words"),
    [
        (dict(tools=TOOLS, tool_choice="auto"), "tool_choice", '"auto" tool choice requires'),
        # OpenAI's default with tools is "auto": the same answer.
        (dict(tools=TOOLS), "tool_choice", '"auto" tool choice requires'),
        (dict(tool_choice="required"), "tool_choice", "`tools` must be set"),
        (dict(tools=[]), "tools", "must not be an empty array"),
        (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
         "tool_choice", "does not match any"),
        (dict(tools=[{"type": "function", "function": {"name": 5}}], tool_choice="required"),
         "tools", "string"),
    ],
)  # fmt: skip
def test_tool_refusals(client: openai.OpenAI, kw: dict[str, Any], param: str, words: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(messages=MESSAGES, **kw, **greedy(max_tokens=2))
    assert e.value.body["param"] == param and words in e.value.body["message"], e.value.body


def test_required_tool_calls_stream_piece_by_piece() -> None:
    """The scanner behind a streamed "required" reply: any cut of the text
    streams the same calls, announced once each, as the whole text holds."""
    text = (
        '[{"name": "a", "parameters": {"s": "x\\"y,}]", "n": [1, {"k": null}]}}, '
        '{"name": "b", "parameters": {}}, {"parameters": {"t": true}, "name": "c"}]'
    )
    expected = {i: (c["name"], c["parameters"]) for i, c in enumerate(json.loads(text))}
    for step in (1, 3, 7, len(text)):
        calls: dict[int, tuple[str, str]] = {}
        for end in range(step, len(text) + step, step):
            delta = extract_required_tool_call_streaming(text[: end - step], text[:end])
            for piece in delta.tool_calls if delta else []:
                assert piece.function is not None
                if piece.id is not None:
                    assert piece.index not in calls
                    calls[piece.index] = (piece.function.name or "", "")
                name, arguments = calls[piece.index]
                calls[piece.index] = (name, arguments + (piece.function.arguments or ""))
        assert {i: (n, json.loads(a)) for i, (n, a) in calls.items()} == expected, step


def test_required_tool_calls_scan_each_character_once() -> None:
    """A stream's scanner resumes where the last delta ended: fed a reply
    one character at a time, it goes through each character once (it
    rescanned the whole reply twice per delta: quadratic, on the event
    loop), and streams what the whole reply holds."""
    calls_in = [{"name": f"f{i}", "parameters": {"s": "x" * i, "n": [i, {"k": None}]}}
                for i in range(60)]  # fmt: skip
    text = json.dumps(calls_in)
    scanner = RequiredToolCallScanner()
    calls: dict[int, tuple[str, str]] = {}
    for ch in text:
        delta = scanner.feed(ch)
        for piece in delta.tool_calls if delta else []:
            assert piece.function is not None
            if piece.id is not None:
                calls[piece.index] = (piece.function.name or "", "")
            name, arguments = calls[piece.index]
            calls[piece.index] = (name, arguments + (piece.function.arguments or ""))
    assert scanner.scanned == len(text)
    assert [(n, json.loads(a)) for n, a in calls.values()] == [
        (c["name"], c["parameters"]) for c in calls_in
    ]


def test_the_server_imports_no_private_name() -> None:
    """The chat handler took sampling_params' private _CONSTRAINTS; what the
    server needs from another module is that module's public surface."""
    import ast

    root = Path(__file__).parent.parent / "tracevllm"
    for path in [*(root / "entrypoints").rglob("*.py"), *(root / "tool_parsers").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tracevllm"):
                private = [a.name for a in node.names if a.name.startswith("_")]
                assert not private, f"{path.relative_to(root)} imports {private} from {node.module}"


def _deep_schema(levels: int) -> dict[str, Any]:
    """An object schema whose properties nest ``levels`` objects deep (2 JSON levels each)."""
    schema: dict[str, Any] = {"type": "object"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


NAMED = {"type": "function", "function": {"name": "deep"}}


@pytest.mark.parametrize("levels", [20, 400])  # past 32 JSON levels; past Python's recursion
@pytest.mark.parametrize("tool_choice", [NAMED, "required", "none", None])
def test_deep_tool_parameters_are_refused_naming_them(
    server: Server, client: openai.OpenAI, tool_choice: Any, levels: int
) -> None:
    """Whatever the tool_choice, a tool's parameters are held to structured
    outputs' limits when the request is read: nested 400 objects deep, a
    named choice was a 500 (a copy recursed), "required" and "none" a 400
    naming messages (the template's tojson recursed); 20 deep, a 400 naming
    structured_outputs."""
    tools = [{"type": "function", "function": {"name": "deep", "parameters": _deep_schema(
        levels)}}]  # fmt: skip
    body = {"messages": MESSAGES, "tools": tools, "max_tokens": 2}
    if tool_choice is not None:
        body["tool_choice"] = tool_choice
    response = post(server, "chat/completions", body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "tools", error
    assert error["message"].startswith("tools[0].function.parameters: the schema nests more "
                                       "than 32 levels"), error  # fmt: skip
    assert client.completions.create(prompt="still there?", **greedy(max_tokens=2)).choices


def test_required_tool_choice_refuses_tools_too_deep_in_its_array(client: openai.OpenAI) -> None:
    """Each tool's parameters within the limits (29 levels), but the
    "required" array holds them 5 levels deeper: a 400 naming tools."""
    tools = [{"type": "function", "function": {"name": "deep", "parameters": _deep_schema(14)}}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(messages=MESSAGES, tools=tools, tool_choice="required",
                                       **greedy(max_tokens=2))  # fmt: skip
    assert e.value.body["param"] == "tools"
    assert 'tool_choice "required" nests them' in e.value.body["message"], e.value.body
    named = client.chat.completions.create(messages=MESSAGES, tools=tools, tool_choice=NAMED,
                                           **greedy(max_tokens=2))  # fmt: skip
    assert named.choices[0].message.tool_calls


# An earlier assistant turn whose call's arguments nest past Python's parser.
DEEP_ARGUMENTS = [
    *MESSAGES,
    {"role": "assistant", "tool_calls": [{"id": "call-1", "type": "function", "function": {
        "name": "get_weather", "arguments": "[" * 5000 + "]" * 5000}}]},
    {"role": "tool", "tool_call_id": "call-1", "content": "18 degrees, dry"},
]  # fmt: skip


def test_deep_tool_call_arguments_are_a_400(client: openai.OpenAI) -> None:
    """json.loads raised RecursionError: a 500."""
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(messages=DEEP_ARGUMENTS, tools=TOOLS,
                                           tool_choice="none", stream=stream,
                                           **greedy(max_tokens=2))  # fmt: skip
        assert e.value.body["param"] == "messages"
        assert "messages[1].tool_calls[0].function.arguments nests" in e.value.body["message"]
    assert client.completions.create(prompt="still there?", **greedy(max_tokens=2)).choices


def test_deep_tool_call_arguments_offline(tiny_model_dir: str) -> None:
    """LLM.chat raised a bare RecursionError; now a ValueError naming the
    arguments, and the same LLM serves the next call. In a child process,
    under a timeout."""
    script = textwrap.dedent(f"""
        import json, sys
        from tracevllm import LLM, SamplingParams
        llm = LLM(model={tiny_model_dir!r}, num_gpu_blocks_override=64,
                  enable_multiprocessing=False)
        params = SamplingParams(temperature=0.0, max_tokens=2)
        try:
            llm.chat(json.loads(sys.stdin.read()), params, use_tqdm=False)
        except ValueError as e:
            print("ValueError:", e)
        print("next:", len(llm.chat({MESSAGES!r}, params, use_tqdm=False)[0].outputs[0].token_ids))
        llm.shutdown()
    """)
    result = subprocess.run([sys.executable, "-c", script], input=json.dumps(DEEP_ARGUMENTS),
                            capture_output=True, text=True, timeout=150)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ValueError: messages[1].tool_calls[0].function.arguments nests" in result.stdout
    assert "next: 2" in result.stdout, result.stdout


# --- fields tracevllm does not implement ------------------------------------------------
REFUSED = [
    # (endpoint, field, value)
    ("completions", "best_of", 3),
    ("completions", "use_beam_search", True),
    ("completions", "guided_json", {"type": "object"}),
    ("completions", "guided_regex", "a+"),
    ("completions", "allowed_token_ids", [1, 2]),
    ("completions", "prompt_logprobs", 1),
    ("chat", "functions", [{"name": "f", "parameters": {}}]),
    ("chat", "function_call", "auto"),
    ("chat", "audio", {"voice": "alloy", "format": "wav"}),
    ("chat", "modalities", ["text", "audio"]),
    ("chat", "guided_choice", ["a", "b"]),
    ("chat", "chat_template_kwargs", {"enable_thinking": True}),
]
# The same fields, asking for nothing: served.
NEUTRAL = [
    ("completions", "best_of", 1),
    ("completions", "use_beam_search", False),
    ("completions", "guided_json", None),
    ("chat", "modalities", ["text"]),
    ("chat", "functions", None),
]


def _create(client: openai.OpenAI, endpoint: str, extra: dict[str, Any]) -> Any:
    if endpoint == "chat":
        return client.chat.completions.create(messages=MESSAGES, **greedy(max_tokens=2,
                                              extra_body=extra))  # fmt: skip
    return client.completions.create(prompt="x", **greedy(max_tokens=2, extra_body=extra))


@pytest.mark.parametrize(("endpoint", "field", "value"), REFUSED)
def test_unimplemented_fields_are_refused_by_name(
    client: openai.OpenAI, endpoint: str, field: str, value: Any
) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        _create(client, endpoint, {field: value})
    body = e.value.body
    assert body["param"] == field and body["message"].startswith(f"{field} is not supported")
    assert body["type"] == "BadRequestError" and body["code"] == 400


@pytest.mark.parametrize(("endpoint", "field", "value"), NEUTRAL)
def test_unimplemented_fields_asking_for_nothing_are_served(
    client: openai.OpenAI, endpoint: str, field: str, value: Any
) -> None:
    assert _create(client, endpoint, {field: value}).choices


def test_unknown_fields_are_logged_and_ignored(server: Server, client: openai.OpenAI) -> None:
    out = _create(client, "completions", {"max_tokenz": 5, "frobnicate": {"a": 1}})
    assert out.choices and out.usage.completion_tokens == 2  # max_tokenz did nothing
    log: Path = server.log  # type: ignore[attr-defined]
    assert "present in the request but ignored: ['frobnicate', 'max_tokenz']" in log.read_text()


# --- 400s that name the field ---------------------------------------------------------
def test_n_null_is_the_default(client: openai.OpenAI) -> None:
    assert len(client.completions.create(prompt="x", n=None, **greedy(max_tokens=2)).choices) == 1
    chat = client.chat.completions.create(messages=MESSAGES, n=None, **greedy(max_tokens=2))
    assert len(chat.choices) == 1


@pytest.mark.parametrize("stream", [False, True])
def test_min_tokens_past_the_longest_choice_is_refused_at_the_entry(
    client: openai.OpenAI, stream: bool
) -> None:
    """A choice is at most one token per byte, then only a stop token, which
    min_tokens forbids: past the longest choice's bytes no token can follow.
    Found at the entry, a stream is a 400 too (it was a 200, then an error
    event); within the bound the request is served."""
    kw = greedy(max_tokens=8, stream=stream)
    for endpoint, extra in (("completions", {}), ("chat", {})):
        with pytest.raises(openai.BadRequestError) as e:
            _create_streamed(client, endpoint, kw, {"structured_outputs": {"choice": ["a", "bc"]},
                                                    "min_tokens": 3, **extra})  # fmt: skip
        assert e.value.body["param"] == "min_tokens", e.value.body
        assert "the longest choice is 2 bytes" in e.value.body["message"]
    # One byte, one token: min_tokens=1 is met by the choice itself.
    out = _create_streamed(client, "completions", kw, {"structured_outputs": {"choice": ["a"]},
                                                       "min_tokens": 1})  # fmt: skip
    assert out == "a"


def test_min_tokens_past_the_longest_choice_offline() -> None:
    from tracevllm import SamplingParams
    from tracevllm.sampling_params import StructuredOutputsParams

    choice = StructuredOutputsParams(choice=["no", "é"])  # "é": 2 bytes in UTF-8
    SamplingParams(min_tokens=2, structured_outputs=choice)
    with pytest.raises(ValueError, match="min_tokens=3 cannot be reached") as e:
        SamplingParams(min_tokens=3, structured_outputs=choice)
    assert getattr(e.value, "parameter", None) == "min_tokens"


def _create_streamed(
    client: openai.OpenAI, endpoint: str, kw: dict[str, Any], extra: dict[str, Any]
) -> str:
    """The text of one request, streamed or not."""
    if endpoint == "chat":
        out = client.chat.completions.create(messages=MESSAGES, extra_body=extra, **kw)
        if not kw.get("stream"):
            return out.choices[0].message.content or ""
        return "".join(c.choices[0].delta.content or "" for c in out if c.choices)
    out = client.completions.create(prompt="x", extra_body=extra, **kw)
    if not kw.get("stream"):
        return out.choices[0].text
    return "".join(c.choices[0].text for c in out if c.choices)


SURROGATE = b'"\\ud800"'  # JSON can escape a lone surrogate; UTF-8 cannot carry it
BAD_BODIES = [
    # (path, body, param, words)
    ("completions", b"", None, "The request body is empty"),
    ("completions", b'{"prompt": "x", "stream_options": {"include_usage": true}}',
     "stream_options", "Stream options can only be defined when `stream=True`"),
    ("completions", b'{"prompt": "x", "model": ' + SURROGATE + b"}", "model", "model is not valid"),
    ("completions", b'{"prompt": "x", "stop": ["a", ' + SURROGATE + b"]}", "stop",
     "stop[1] is not valid Unicode"),
    ("completions", b'{"prompt": ' + SURROGATE + b"}", "prompt", "prompt is not valid"),
    ("chat/completions", b'{"messages": [{"role": ' + SURROGATE + b', "content": "hi"}]}',
     "messages", "messages[0].role is not valid Unicode"),
    ("chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": '
     b'"function", "function": {"name": "f", "parameters": {' + SURROGATE + b': 1}}}]}',
     "tools", "a key in tools[0].function.parameters is not valid"),
    ("chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], '
     b'"chat_template": "{{ 1 / 0 }}"}', "chat_template", "ZeroDivisionError"),
    ("chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], '
     b'"chat_template": "{{ messages[3].x }}"}', "chat_template", "failed to render"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "param", "words"), BAD_BODIES)
def test_bad_bodies_are_400s_naming_the_field(
    server: Server, client: openai.OpenAI, path: str, body: bytes, param: str | None, words: str
) -> None:
    response = post(server, path, body)
    assert response.status_code == 400, response.text
    assert response.json()["error"] == {
        "message": response.json()["error"]["message"],
        "type": "BadRequestError",
        "param": param,
        "code": 400,
    }
    assert words in response.json()["error"]["message"], response.text
    assert client.completions.create(prompt="still there?", **greedy(max_tokens=2)).choices
