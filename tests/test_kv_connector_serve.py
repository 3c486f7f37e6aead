"""KV connectors over HTTP: ``tracevllm serve --kv-transfer-config`` and vLLM's
``kv_transfer_params`` in the OpenAI request and response.

A prefill server (``kv_producer``) answers with ``max_tokens=1`` and returns
``kv_transfer_params``; a decode server (``kv_consumer``) given them (the
official client's ``extra_body``) loads the prompt's KV and answers as one
engine does, for completions and chat completions.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest

from tests.utils import make_tiny_llama
from tracevllm import LLM, SamplingParams
from tracevllm.entrypoints.openai.server_process import ServerProcess, free_port

# Two servers start at once; on a busy machine that takes minutes.
pytestmark = pytest.mark.timeout(900)

MODEL = "tiny"
PROMPT = list(range(40, 81))  # 41 tokens: 40 kept (5 blocks of 8), 1 computed
MESSAGES = [{"role": "user", "content": "Where do the keys and values of a prompt go?"}]


class Server(ServerProcess):
    def __init__(self, model_dir: str, kv_transfer_config: dict[str, Any]) -> None:
        port = free_port()
        super().__init__(
            [sys.executable, "-m", "tracevllm.entrypoints.cli", "serve", model_dir,
             "--port", str(port), "--served-model-name", MODEL, "--block-size", "8",
             "--num-gpu-blocks-override", "64", "--uvicorn-log-level", "warning",
             "--kv-transfer-config", json.dumps(kv_transfer_config)],
            port,
            env={**os.environ, "PYTHONPATH": os.getcwd()},
            timeout=600,
        )  # fmt: skip

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("kv-serve-llama"))
    return make_tiny_llama(path, seed=0, initializer_range=0.08)


@pytest.fixture(scope="module")
def servers(
    model_dir: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Server, Server]]:
    store = str(tmp_path_factory.mktemp("kv-serve-store"))
    extra = {"kv_connector_extra_config": {"shared_storage_path": store}}
    config = {"kv_connector": "ExampleConnector", **extra}
    with ThreadPoolExecutor(2) as pool:
        starting = [
            pool.submit(Server, model_dir, {**config, "kv_role": role})
            for role in ("kv_producer", "kv_consumer")
        ]
    if errors := [f.exception() for f in starting if f.exception() is not None]:
        for f in starting:
            if f.exception() is None:
                f.result().stop()
        raise errors[0]  # type: ignore[misc]
    prefill, decode = (f.result() for f in starting)
    yield prefill, decode
    assert prefill.stop() == 0
    assert decode.stop() == 0


def test_completion_through_prefill_then_decode_server(
    model_dir: str, servers: tuple[Server, Server]
) -> None:
    prefill, decode = servers
    with LLM(model=model_dir, block_size=8, enable_multiprocessing=False) as llm:
        (expected,) = llm.generate(
            [{"prompt_token_ids": PROMPT}],
            SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
            use_tqdm=False,
        )
    first = prefill.client().completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0.0
    )
    kv_transfer_params = (first.model_extra or {})["kv_transfer_params"]
    assert kv_transfer_params["do_remote_prefill"] is True
    answer = decode.client().completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=10,
        temperature=0.0,
        extra_body={"kv_transfer_params": kv_transfer_params, "ignore_eos": True},
    )
    assert answer.choices[0].text == expected.outputs[0].text
    # The consumer returns none of its own.
    assert (answer.model_extra or {}).get("kv_transfer_params") is None


def test_chat_carries_kv_transfer_params_both_ways(servers: tuple[Server, Server]) -> None:
    prefill, decode = servers
    first = prefill.client().chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=1,
        temperature=0.0,  # type: ignore[arg-type]
    )
    kv_transfer_params = (first.model_extra or {})["kv_transfer_params"]
    assert kv_transfer_params == {"do_remote_prefill": True}
    plain = prefill.client().chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=8,
        temperature=0.0,  # type: ignore[arg-type]
    )
    answer = decode.client().chat.completions.create(
        model=MODEL,
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=8,
        temperature=0.0,
        extra_body={"kv_transfer_params": kv_transfer_params},
    )
    assert answer.choices[0].message.content == plain.choices[0].message.content
    with pytest.raises(openai.BadRequestError):
        decode.client().completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=2, extra_body={"kv_transfer_params": [1]}
        )


def test_kv_transfer_params_with_several_prompts_or_n_is_refused(
    servers: tuple[Server, Server],
) -> None:
    """kv_transfer_params name one prompt's blocks: with several prompts or
    n > 1 the request is a 400 naming the field, before any engine sees it
    (before: a prefill server held every prompt's blocks and returned the
    first's params; a decode server read the same blocks into each)."""
    prefill, decode = servers
    params = {"do_remote_decode": True}
    for server in (prefill, decode):
        for kwargs in (
            {"prompt": [PROMPT, PROMPT[:20]]},
            {"prompt": ["one", "two"]},
            {"prompt": PROMPT, "n": 2},
        ):
            with pytest.raises(openai.BadRequestError) as e:
                server.client().completions.create(
                    model=MODEL, max_tokens=1, extra_body={"kv_transfer_params": params}, **kwargs
                )
            assert e.value.body["param"] == "kv_transfer_params", e.value.body  # type: ignore[index]
        with pytest.raises(openai.BadRequestError) as e:
            server.client().chat.completions.create(
                model=MODEL,
                messages=MESSAGES,  # type: ignore[arg-type]
                max_tokens=1,
                n=2,
                extra_body={"kv_transfer_params": params},
            )
        assert e.value.body["param"] == "kv_transfer_params", e.value.body  # type: ignore[index]
    # One prompt (a list of one too) and n = 1 are served.
    first = prefill.client().completions.create(
        model=MODEL, prompt=[PROMPT], max_tokens=1, extra_body={"kv_transfer_params": params}
    )
    assert (first.model_extra or {})["kv_transfer_params"]["do_remote_prefill"] is True


def test_the_request_models_refuse_kv_transfer_params_with_several_prompts_or_n() -> None:
    """The check itself, each prompt form (no server needed)."""
    from pydantic import ValidationError

    from tracevllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from tracevllm.entrypoints.openai.completion.protocol import CompletionRequest

    params = {"do_remote_prefill": True}
    for prompt in ("text", [1, 2, 3], ["text"], [[1, 2, 3]]):
        CompletionRequest(model=MODEL, prompt=prompt, kv_transfer_params=params)
    CompletionRequest(model=MODEL, prompt=["a", "b"], n=2)  # without params: served
    for prompt, n in ((["a", "b"], 1), ([[1], [2]], 1), ("text", 2), ([1, 2], 3)):
        with pytest.raises(ValidationError, match="kv_transfer_params serves one prompt"):
            CompletionRequest(model=MODEL, prompt=prompt, n=n, kv_transfer_params=params)
    ChatCompletionRequest(model=MODEL, messages=MESSAGES, kv_transfer_params=params)
    ChatCompletionRequest(model=MODEL, messages=MESSAGES, n=2)
    with pytest.raises(ValidationError, match="got n = 2"):
        ChatCompletionRequest(model=MODEL, messages=MESSAGES, n=2, kv_transfer_params=params)


def test_params_that_ask_for_no_transfer_are_not_refused() -> None:
    """Only params that ask a connector for something (do_remote_prefill or
    do_remote_decode true) are limited to one prompt and n = 1; the
    connectors ignore the rest (mutation caught: any non-empty params
    checked -> the first request model raises)."""
    from pydantic import ValidationError

    from tracevllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from tracevllm.entrypoints.openai.completion.protocol import CompletionRequest

    for params in ({"do_remote_decode": False}, {"do_remote_prefill": 0}, {"other": True}):
        CompletionRequest(model=MODEL, prompt=["a", "b"], n=2, kv_transfer_params=params)
        ChatCompletionRequest(model=MODEL, messages=MESSAGES, n=2, kv_transfer_params=params)
    with pytest.raises(ValidationError, match="got n = 2"):
        CompletionRequest(model=MODEL, prompt="a", n=2, kv_transfer_params={"do_remote_decode": 1})


def test_a_prefill_server_refuses_do_remote_decode_with_more_than_one_token(
    servers: tuple[Server, Server],
) -> None:
    """A kv_producer holds a do_remote_decode request's blocks for the decode
    server once it finishes; vLLM's proxy sends max_tokens = 1, and any other
    count is a 400 naming the field that set it (mutation caught: the role
    check dropped -> the decode server refuses too; the check removed -> all
    served)."""
    prefill, decode = servers
    params = {"do_remote_decode": True}
    asks: list[tuple[str, dict[str, Any]]] = [
        ("max_tokens", {"prompt": PROMPT, "max_tokens": 2}),
        ("max_tokens", {"prompt": PROMPT}),  # the default, 16
    ]
    for param, kwargs in asks:
        with pytest.raises(openai.BadRequestError) as e:
            prefill.client().completions.create(
                model=MODEL, extra_body={"kv_transfer_params": params}, **kwargs
            )
        assert e.value.body["param"] == param, e.value.body  # type: ignore[index]
        assert "do_remote_decode" in e.value.body["message"]  # type: ignore[index]
    chat_asks: list[tuple[str, dict[str, Any]]] = [
        ("max_tokens", {"max_tokens": 4}),
        ("max_completion_tokens", {"max_completion_tokens": 4}),
        ("max_tokens", {}),  # what the context leaves
    ]
    for param, kwargs in chat_asks:
        with pytest.raises(openai.BadRequestError) as e:
            prefill.client().chat.completions.create(
                model=MODEL,
                messages=MESSAGES,  # type: ignore[arg-type]
                extra_body={"kv_transfer_params": params},
                **kwargs,
            )
        assert e.value.body["param"] == param, e.value.body  # type: ignore[index]
    # Served: one token on the prefill server; params asking nothing, any
    # count, n = 2 too; and a decode server (kv_consumer) is not limited.
    first = prefill.client().chat.completions.create(
        model=MODEL,
        messages=MESSAGES,  # type: ignore[arg-type]
        max_completion_tokens=1,
        extra_body={"kv_transfer_params": params},
    )
    assert (first.model_extra or {})["kv_transfer_params"]["do_remote_prefill"] is True
    several = prefill.client().completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=2,
        n=2,
        extra_body={"kv_transfer_params": {"do_remote_decode": False}},
    )
    assert len(several.choices) == 2
    decode.client().completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=2, extra_body={"kv_transfer_params": params}
    )


def test_the_one_token_rule_is_for_kv_producer_servers_only() -> None:
    """A kv_producer holds a do_remote_decode request's blocks for a reader
    and asks for one token; kv_both (the OffloadingConnector's and
    ExampleConnector's usual role, which hold nothing for a reader), a
    kv_consumer and a server without a connector serve it (mutation caught:
    vLLM's is_kv_producer as the test -> kv_both refuses 8 tokens)."""
    from tracevllm.distributed.kv_transfer.kv_transfer_config import KVTransferConfig
    from tracevllm.entrypoints.openai.engine.generate_request import (
        check_kv_transfer_params_producer,
    )
    from tracevllm.exceptions import VLLMValidationError

    params = {"do_remote_decode": True}
    producer = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_producer")
    with pytest.raises(VLLMValidationError, match="needs max_tokens = 1, got 8"):
        check_kv_transfer_params_producer(params, 8, producer)
    check_kv_transfer_params_producer(params, 1, producer)
    for role in ("kv_both", "kv_consumer"):
        config = KVTransferConfig(kv_connector="OffloadingConnector", kv_role=role)
        check_kv_transfer_params_producer(params, 8, config)
    check_kv_transfer_params_producer(params, 8, None)
