"""Where a request's prompt KV came from, block by block: computed, a local
prefix hit, the offload tier, or a remote engine.

tracevllm's own view (vLLM counts the same split in ``PrefillStats`` and its
``vllm:prompt_tokens_by_source`` metric, by request and by source, not by
block). Drawn from a step view (tracing/step_view.py) of an engine with a
KV connector: each request admitted in that step carries
``num_local_cached_tokens`` (the local prefix cache's hit, always the
prompt's first blocks), ``num_external_cached_tokens`` (what the connector
loaded, the blocks after it) and, after those, what the step computes. The
connector says where its tokens came from: the ``OffloadingConnector``'s
from this engine's own offload tier, the others' (``NixlConnector``,
``ExampleConnector``) from the engine that computed the prompt. One letter
per block, after the source of most of its tokens (a remote prompt's last
token, which the decode engine computes again, makes its block ``C`` only
when it is alone there); the counts beside the blocks are exact, in tokens.
"""

from __future__ import annotations

from typing import Any

from rich.console import RenderableType
from rich.table import Table
from rich.text import Text

# Connectors whose tokens come from this engine's own second tier.
OFFLOAD_CONNECTORS = ("OffloadingConnector",)
# (letter, label, style) by origin, in prompt order.
ORIGINS = {
    "hit": ("H", "prefix hit", "cyan"),
    "offload": ("O", "offload tier", "magenta"),
    "remote": ("R", "remote", "yellow"),
    "computed": ("C", "computed", "green"),
}


def prompt_origins(req: dict[str, Any], connector: str | None) -> list[tuple[str, int]]:
    """``[(origin, tokens), ...]`` in prompt order, for a request of a step
    view that carries its split (else an empty list)."""
    if "num_local_cached_tokens" not in req:
        return []
    local, external = req["num_local_cached_tokens"], req["num_external_cached_tokens"]
    computed = req["num_prompt_tokens"] - local - external
    where = "offload" if connector in OFFLOAD_CONNECTORS else "remote"
    return [("hit", local), (where, external), ("computed", max(computed, 0))]


def block_letters(origins: list[tuple[str, int]], block_size: int) -> list[str]:
    """Each prompt block's origin: the one most of its tokens came from (the
    later one on a tie)."""
    spans: list[tuple[int, int, str]] = []  # [start, end) token ranges
    start = 0
    for origin, n in origins:
        spans.append((start, start + n, origin))
        start += n
    letters = []
    for b in range(0, start, block_size):
        end = min(b + block_size, start)
        counts = [(max(0, min(e, end) - max(s, b)), i, o) for i, (s, e, o) in enumerate(spans)]
        letters.append(max(counts)[2])
    return letters


def render_block_origin(view: dict[str, Any]) -> RenderableType | None:
    """A table of the step's newly admitted requests and where each prompt
    block came from; None without a connector or such a request."""
    connector = view.get("kv_connector")
    rows = [(r, prompt_origins(r, connector)) for r in view["requests"]]
    rows = [(r, o) for r, o in rows if o]
    if connector is None or not rows:
        return None
    table = Table(
        title=f"Prompt KV by origin · {connector}",
        title_justify="left",
        caption="one letter a block: H prefix hit · O offload tier · R remote · C computed",
        caption_justify="left",
    )
    table.add_column("request")
    table.add_column("blocks")
    table.add_column("tokens")
    for req, origins in rows:
        strip = Text()
        for origin in block_letters(origins, view["block_size"]):
            letter, _, style = ORIGINS[origin]
            strip.append(letter, style=f"bold {style}")
        counts = Text()
        for origin, n in origins:
            if n:
                _, label, style = ORIGINS[origin]
                counts.append(("" if not counts else " · ") + f"{label} {n}", style=style)
        table.add_row(req["req_id"], strip, counts)
    return table
