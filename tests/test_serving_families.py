"""A family other than Llama through ``tracevllm serve``.

A tiny random-weight Qwen3 (written by HF's own Qwen3ForCausalLM, with its
q/k norms drawn at random so they matter) served by a real ``tracevllm serve``
on 127.0.0.1 (tests/test_serving.py's ``Server``) and driven by the official
``openai`` client: a completion and a chat completion give, token for token,
the offline ``LLM``'s greedy output for the same prompt.
"""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
import torch

from tests.family_check import new_checkpoint_dir, save_hf_model, tiny_config_kwargs
from tests.test_serving import MODEL, Server
from tracevllm import LLM, SamplingParams

pytestmark = pytest.mark.timeout(300)

PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    path, vocab_size = new_checkpoint_dir(tmp_path_factory, "tiny-qwen3-serve")
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**tiny_config_kwargs(vocab_size, head_dim=32))).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                param.normal_(1.0, 0.5)
    save_hf_model(model, path)
    return path


@pytest.fixture(scope="module")
def client(qwen3_dir: str) -> Iterator[openai.OpenAI]:
    server = Server(qwen3_dir)
    try:
        yield server.client()
    finally:
        assert server.stop() == 0


def _offline(path: str, prompt_ids: list[int], ignore_eos: bool) -> tuple[list[str], str]:
    """The offline engine's greedy tokens (as text pieces) and text."""
    params = SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=ignore_eos, logprobs=0
    )
    with LLM(model=path, enable_multiprocessing=False) as llm:
        (output,) = llm.generate([{"prompt_token_ids": prompt_ids}], params, use_tqdm=False)
    completion = output.outputs[0]
    assert completion.logprobs is not None and len(completion.token_ids) > 0
    pieces = [
        lp[t].decoded_token or ""
        for lp, t in zip(completion.logprobs, completion.token_ids, strict=True)
    ]
    return pieces, completion.text


def test_qwen3_served_equals_offline(qwen3_dir: str, client: openai.OpenAI) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(qwen3_dir)
    assert client.models.list().data[0].id == MODEL

    # A completion: the prompt encoded as the server encodes it.
    prompt_ids = tokenizer.encode(PROMPT)
    pieces, text = _offline(qwen3_dir, prompt_ids, ignore_eos=True)
    out = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        logprobs=0,
        extra_body={"ignore_eos": True},
    )
    choice = out.choices[0]
    assert out.usage is not None and out.usage.prompt_tokens == len(prompt_ids)
    assert out.usage.completion_tokens == MAX_TOKENS == len(pieces)
    assert choice.logprobs is not None and choice.logprobs.tokens == pieces
    assert choice.text == text

    # A chat completion: the reference renders the template with HF's tokenizer.
    chat = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    chat_ids = tokenizer.encode(chat, add_special_tokens=False)
    pieces, text = _offline(qwen3_dir, chat_ids, ignore_eos=False)
    reply = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0.0, logprobs=True
    )
    message = reply.choices[0]
    assert reply.usage is not None and reply.usage.prompt_tokens == len(chat_ids)
    assert reply.usage.completion_tokens == len(pieces)
    assert message.logprobs is not None and message.logprobs.content is not None
    assert [c.token for c in message.logprobs.content] == pieces
    assert message.message.content == text
