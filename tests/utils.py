"""Test helpers: a tiny random-weight Llama, made on the fly and seeded; a
scenario run in a child process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_json_lines(module: str, *args: str, timeout: float) -> list[dict[str, Any]]:
    """``python -m module args...`` in a child process, from the repository's
    root, under ``timeout`` (a hang or a crash fails the test, not pytest):
    the JSON objects it printed, one a line. A non-zero exit fails with the
    end of its stderr."""
    proc = subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO_ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


# A ChatML template like SmolLM2's, so chat() works on the tiny model too.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_CORPUS = [
    "The capital of France is Paris. The capital of Germany is Berlin.",
    "A paged KV cache stores keys and values in fixed-size blocks.",
    "The scheduler decides which requests run in each step of the engine.",
    "Hello, world! How are you today? I am fine, thank you.",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
]


def make_tiny_tokenizer(path: str, vocab_size: int = 512) -> Any:
    """A byte-level BPE trained on a few sentences (deterministic, ~0.1 s).

    Any text encodes (byte fallback), so prompts need not come from the corpus.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return fast


def make_tiny_llama(
    path: str, seed: int = 0, tokenizer_from: str | None = None, **overrides: Any
) -> str:
    """Write a tiny random-weight HF Llama directory (config, safetensors, tokenizer).

    2 layers, hidden 64, 4 query / 2 KV heads by default; ``overrides`` go to
    ``LlamaConfig`` (e.g. ``num_key_value_heads=1``, ``tie_word_embeddings=True``).
    The same seed gives the same weights. The tokenizer is a small byte-level
    BPE made here, or, with ``tokenizer_from``, a copy of that model directory's
    tokenizer (e.g. the default model's: its 49152-token vocabulary, its chat
    template); the vocabulary size follows the tokenizer.
    """
    import torch
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    os.makedirs(path, exist_ok=True)
    if tokenizer_from is None:
        tokenizer = make_tiny_tokenizer(path)
    else:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_from)
        tokenizer.save_pretrained(path)
    kwargs: dict[str, Any] = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    kwargs.update(overrides)
    config = LlamaConfig(**kwargs)
    torch.manual_seed(seed)
    # Default init has std 0.02: scale up so logits are not all near-ties.
    config.initializer_range = kwargs.get("initializer_range", 0.1)
    model = LlamaForCausalLM(config).eval()  # float32: the default dtype
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    model.save_pretrained(path, safe_serialization=True)
    return path


class OTLPCollector:
    """A real OTLP/HTTP (JSON) collector on 127.0.0.1: ``with OTLPCollector() as c``,
    point an exporter at ``c.endpoint``, read what arrived from ``c.received``."""

    def __init__(self) -> None:
        self.received: list[tuple[str, dict[str, Any]]] = []

    def __enter__(self) -> OTLPCollector:
        import json
        import threading
        from http.server import BaseHTTPRequestHandler, HTTPServer

        received = self.received

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                received.append((self.path, json.loads(body)))
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *args: Any) -> None:
                pass

        self.server = HTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_port}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()

    def spans(self) -> list[dict[str, Any]]:
        """Every span received, with its process's resource attributes under "resource"."""
        out = []
        for _, body in self.received:
            for rs in body["resourceSpans"]:
                resource = {
                    a["key"]: next(iter(a["value"].values())) for a in rs["resource"]["attributes"]
                }
                for ss in rs["scopeSpans"]:
                    out += [{**span, "resource": resource} for span in ss["spans"]]
        return out
