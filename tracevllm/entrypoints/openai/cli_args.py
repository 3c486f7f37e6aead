"""The flags of ``tracevllm serve``: the server's, then every engine flag.

Mirrors vllm/entrypoints/openai/cli_args.py (``make_arg_parser``), with vLLM's
spelling (``--host``, ``--port``, ``--api-key``, ``--served-model-name``,
``--uvicorn-log-level``). The server's own defaults differ in one place:
``--host`` is 127.0.0.1, so a server is not reachable from other machines
unless asked (vLLM binds every interface).
"""

from __future__ import annotations

import argparse

from tracevllm.engine.arg_utils import EngineArgs


def make_arg_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument(
        "model_tag", nargs="?", default=None, help="the model (as --model; default: SmolLM2)"
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    parser.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="the name(s) clients use for the model (default: --model)",
    )
    parser.add_argument(
        "--max-request-body-size",
        type=int,
        default=16 * 1024 * 1024,
        help="larger request bodies get a 413 (bytes)",
    )
    parser.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="run a chat_template sent with a request (off: such a request is a 400)",
    )
    parser.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=("critical", "error", "warning", "info", "debug", "trace"),
    )
    return EngineArgs.add_cli_args(parser)
