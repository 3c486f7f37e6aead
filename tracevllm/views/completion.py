"""The end of a request: its text, finish reason, TTFT and inter-token latencies."""

from __future__ import annotations

from typing import Any

from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text


def render_completion(attrs: dict[str, Any]) -> RenderableType:
    """From the attributes of an ``llm_request`` span."""
    text = attrs.get("tracevllm.completion.text", "")
    itl = attrs.get("tracevllm.latency.inter_token_ms") or []
    grid = Table.grid(padding=(0, 2))
    grid.add_row("request", str(attrs.get("gen_ai.request.id", "?")))
    grid.add_row("finish reason", ", ".join(attrs.get("gen_ai.response.finish_reasons") or []))
    grid.add_row(
        "tokens",
        f"{attrs.get('gen_ai.usage.input_tokens', '?')} in → "
        f"{attrs.get('gen_ai.usage.output_tokens', '?')} out",
    )
    ttft = attrs.get("gen_ai.latency.time_to_first_token")
    if ttft is not None:
        grid.add_row("time to first token", f"{ttft * 1e3:.1f} ms")
    grid.add_row("end to end", f"{attrs.get('gen_ai.latency.e2e', 0) * 1e3:.1f} ms")
    if itl:
        mean = sum(itl) / len(itl)
        grid.add_row(
            "inter-token latency",
            f"mean {mean:.1f} ms · min {min(itl):.1f} · max {max(itl):.1f} ({len(itl)} gaps)",
        )
    drafts = attrs.get("tracevllm.spec_decode.num_draft_tokens")
    if drafts:
        accepted = attrs.get("tracevllm.spec_decode.num_accepted_tokens", 0)
        steps = attrs.get("tracevllm.spec_decode.num_drafts", 0)
        grid.add_row(
            "drafts kept",
            f"{accepted} of {drafts} ({accepted / drafts:.0%}) over {steps} steps with drafts",
        )
    return Panel(
        Group(Text(text, style="bold"), Text(""), grid),
        title="Completion",
        title_align="left",
        border_style="green",
    )
