"""The flags of ``tracevllm serve``: the server's, then every engine flag.

Mirrors vllm/entrypoints/openai/cli_args.py (``make_arg_parser``), with vLLM's
spelling (``--host``, ``--port``, ``--api-key``, ``--served-model-name``,
``--uvicorn-log-level``). The server's own defaults differ in one place:
``--host`` is 127.0.0.1, so a server is not reachable from other machines
unless asked (vLLM binds every interface).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from tracevllm.engine.arg_utils import EngineArgs

# vLLM's (vllm/entrypoints/constants.py): the most bytes of a request line and
# headers h11 buffers before they are complete.
H11_MAX_INCOMPLETE_EVENT_SIZE_DEFAULT = 4 * 1024 * 1024


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
    # The server under load (entrypoints/launcher.py). The idle keep-alive
    # timeout is vLLM's environment variable: TRACEVLLM_HTTP_TIMEOUT_KEEP_ALIVE.
    parser.add_argument(
        "--limit-concurrency",
        type=_whole_number(1),
        default=None,
        metavar="N",
        help="uvicorn's: with N connections or requests at once, a new request gets a 503 "
        "(default: no limit but the open-file limit)",
    )
    parser.add_argument(
        "--request-read-timeout",
        type=_seconds,
        default=30.0,
        metavar="S",
        help="close a connection that has not sent a whole request (headers and body) "
        "S seconds after it opened or after its previous response (default 30)",
    )
    parser.add_argument(
        "--h11-max-incomplete-event-size",
        type=_whole_number(1),
        default=H11_MAX_INCOMPLETE_EVENT_SIZE_DEFAULT,
        metavar="BYTES",
        help="the most bytes of a request line and headers the server buffers "
        "(vLLM's; default 4 MiB)",
    )
    return EngineArgs.add_cli_args(parser)


# argparse names the flag before these messages.
def _whole_number(least: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = least - 1
        if value < least:
            raise argparse.ArgumentTypeError(f"takes a whole number >= {least}, got {text!r}")
        return value

    return parse


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:  # NaN fails too
        raise argparse.ArgumentTypeError(f"takes a number of seconds > 0, got {text!r}")
    return value
