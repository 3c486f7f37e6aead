"""mkdocs hook: where a chapter sits on the request's path, and whose code an
embed shows.

- Every chapter of the request's path opens, under its title, with the path:
  the stage before it, this stage, the stage after it, and what this stage
  takes in and hands on (``STAGES``), so a reader who opens any chapter knows
  where the request is.
- Every code block that embeds the source (a fence holding only a
  ``--8<-- "path:section"`` line) gets the file's path as its title, unless it
  has one: the reader always sees which file the code comes from.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import Files
from mkdocs.structure.pages import Page


class Stage(NamedTuple):
    page: str  # under docs/chapters/
    name: str  # short, for the path strip
    takes: str  # what the stage is handed
    hands_on: str  # what it passes to the next


# The request's path, in the order a request meets the stages.
STAGES = [
    Stage("entry.md", "Entry", "a prompt string and `SamplingParams`", "an `EngineCoreRequest`"),
    Stage(
        "engine-core.md",
        "EngineCore loop",
        "an `EngineCoreRequest`, over ZeroMQ",
        "a `Request` in the scheduler's waiting queue, and one `step()` after another",
    ),
    Stage(
        "scheduling.md",
        "Scheduling",
        "the waiting and running `Request`s",
        "a `SchedulerOutput`: tokens per request, and their KV blocks",
    ),
    Stage(
        "kv-cache.md",
        "KV cache",
        "a request and how many tokens it runs",
        "block ids (or `None`: preempt someone)",
    ),
    Stage(
        "input-preparation.md",
        "Input preparation",
        "a `SchedulerOutput`",
        "one flat batch: `input_ids`, `positions`, `slot_mapping`, attention metadata",
    ),
    Stage(
        "model-execution.md",
        "Model",
        "the flat batch",
        "one row of logits per request",
    ),
    Stage(
        "paged-attention.md",
        "PagedAttention",
        "each layer's `q`, `k`, `v` and the step's metadata",
        "attention outputs; this step's K/V in the cache",
    ),
    Stage(
        "sampling.md",
        "Sampling and output",
        "one row of logits per request",
        "a token per request, then text in a `RequestOutput`",
    ),
]

# A fence whose only line embeds a source section; group 1: its indentation.
EMBED = re.compile(
    r"^(?P<indent>[ \t]*)```(?P<lang>\w+)(?P<opts>[^\n]*)\n"
    r'(?P=indent)--8<-- "(?P<path>[^":]+)(?::[^"]*)?"\n'
    r"(?P=indent)```",
    re.MULTILINE,
)


def path_strip(page: str) -> str:
    """The markdown that opens a chapter of the request's path ('' for others)."""
    pages = [s.page for s in STAGES]
    if page not in pages:
        return ""
    i = pages.index(page)
    stage = STAGES[i]
    chain = " → ".join(
        f"**{s.name}**" if s.page == page else f"[{s.name}]({s.page})" for s in STAGES
    )
    before = f"from [{STAGES[i - 1].name}]({STAGES[i - 1].page})" if i else "from your script"
    after = (
        f"to [{STAGES[i + 1].name}]({STAGES[i + 1].page})"
        if i + 1 < len(STAGES)
        else ("back to your script")
    )
    return (
        '<div class="request-path" markdown>\n'
        f"{chain}\n\n"
        f"**In:** {stage.takes}, {before}. **Out:** {stage.hands_on}, {after}.\n"
        "</div>\n"
    )


def add_path(markdown: str, page: str) -> str:
    strip = path_strip(page)
    if not strip:
        return markdown
    title, sep, rest = markdown.partition("\n")
    return f"{title}\n\n{strip}{sep}{rest}"


def title_embeds(markdown: str) -> str:
    def titled(m: re.Match[str]) -> str:
        if "title=" in m["opts"]:
            return m[0]
        head = f'{m["indent"]}```{m["lang"]}{m["opts"]} title="{m["path"]}"'
        return head + m[0][m[0].index("\n") :]

    return EMBED.sub(titled, markdown)


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    uri = page.file.src_uri
    if uri.startswith("chapters/"):
        markdown = add_path(markdown, uri.removeprefix("chapters/"))
    return title_embeds(markdown)
