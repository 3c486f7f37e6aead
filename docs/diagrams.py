"""The book's diagrams, drawn as SVG from a recorded run's numbers.

``docs/record_assets.py`` calls these with what the spans of its runs say
(block ids, ref counts, token counts, the free queue), so a re-recording
redraws them and a picture cannot disagree with the tables beside it. Each
function returns the SVG text; widths stay under the book's content column so
the text is shown at its own size.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from html import escape

REQUEST_COLORS = ["#3f51b5", "#00897b", "#ef6c00", "#8e24aa"]
GREY, LIGHT, CACHED, INK = "#9e9e9e", "#eeeeee", "#ffe082", "#212121"
FONT = "font-family: ui-sans-serif, system-ui, sans-serif; font-size: 13px"
MONO = "font-family: ui-monospace, monospace; font-size: 12px"
# Verdicts: a draft kept, rejected, the bonus token (also: a bit set / the sign bit).
ACCEPT, REJECT, BONUS, UNUSED = "#43a047", "#e53935", "#1e88e5", "#bdbdbd"


def color(req_id: str) -> str:
    return REQUEST_COLORS[int(req_id) % len(REQUEST_COLORS)] if req_id.isdigit() else GREY


# What a character takes, in px, at the sizes above: the sans-serif's average
# and the monospace's advance (0.6 em). A label is measured with these, so that
# a picture whose label would run past its edge fails to draw.
CHAR_W, MONO_W = 7.2, 7.2


def text_extent(x: float, s: str, anchor: str, mono: bool) -> tuple[float, float]:
    """(left, right) of a label, in px, as the estimate above puts it."""
    w = len(s) * (MONO_W if mono else CHAR_W)
    left = {"start": x, "middle": x - w / 2, "end": x - w}[anchor]
    return left, left + w


class LabelOutside(ValueError):
    """A label runs past the picture's edge: the reader would see it cut."""


class Svg:
    def __init__(self, width: int, height: int, title: str) -> None:
        self.width, self.height, self.title = width, height, title
        self.parts: list[str] = []
        self.outside: list[str] = []

    def rect(
        self, x: float, y: float, w: float, h: float, fill: str, stroke: str = "#ffffff"
    ) -> None:
        self.parts.append(
            f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" '
            f'fill="{fill}" stroke="{stroke}"/>'
        )

    def text(
        self,
        x: float,
        y: float,
        s: str,
        fill: str = INK,
        anchor: str = "start",
        mono: bool = False,
        bold: bool = False,
    ) -> None:
        weight = ' font-weight="bold"' if bold else ""
        left, right = text_extent(x, s, anchor, mono)
        # Bold runs a little wider than the estimate.
        if left < 0 or right * (1.08 if bold else 1.0) > self.width or y > self.height:
            self.outside.append(f"{s!r} spans x {left:.0f}..{right:.0f}, y {y:.0f}")
        self.parts.append(
            f'<text x="{x:.1f}" y="{y:.1f}" fill="{fill}" text-anchor="{anchor}" '
            f'style="{MONO if mono else FONT}"{weight}>{escape(s)}</text>'
        )

    def line(self, x1: float, y1: float, x2: float, y2: float, stroke: str = INK) -> None:
        self.parts.append(
            f'<line x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2:.1f}" '
            f'stroke="{stroke}" stroke-width="1.5" marker-end="url(#arrow)"/>'
        )

    def render(self) -> str:
        if self.outside:
            raise LabelOutside(
                f"{self.title}: {len(self.outside)} label(s) past the {self.width}x"
                f"{self.height} picture: " + "; ".join(self.outside)
            )
        return (
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{self.width}" '
            f'height="{self.height}" viewBox="0 0 {self.width} {self.height}" role="img">\n'
            f"<title>{escape(self.title)}</title>\n"
            '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" '
            'markerWidth="6" markerHeight="6" orient="auto-start-reverse">'
            f'<path d="M 0 0 L 10 5 L 0 10 z" fill="{INK}"/></marker></defs>\n'
            f'<rect width="{self.width}" height="{self.height}" fill="#ffffff"/>\n'
            + "\n".join(self.parts)
            + "\n</svg>\n"
        )


def legend(svg: Svg, y: float, items: Sequence[tuple[str, str]], x: float = 10) -> None:
    for label, fill in items:
        svg.rect(x, y - 11, 14, 14, fill, stroke=GREY)
        svg.text(x + 20, y, label)
        x += 30 + 7.2 * len(label)


# -------------------------------------------------------- chunked prefill
def budget_timeline(
    steps: Sequence[tuple[int, Sequence[tuple[str, int, str]]]], budget: int
) -> str:
    """One row per step: the token budget, cell by cell, and who got it.

    ``steps``: (step, [(req_id, tokens scheduled, what they are)]).
    """
    cell, left, top, row_h = 21, 70, 44, 34
    width = left + budget * cell + 90
    svg = Svg(width, top + row_h * len(steps) + 34, f"Who gets the {budget}-token budget")
    reqs = sorted({r for _, rows in steps for r, _, _ in rows})
    legend(svg, 18, [(f"request {r}", color(r)) for r in reqs] + [("unused", LIGHT)])
    for i, (step, rows) in enumerate(steps):
        y = top + i * row_h
        svg.text(left - 10, y + 19, f"step {step}", anchor="end")
        x = left
        for req_id, n, what in rows:
            svg.rect(x, y, n * cell, 26, color(req_id))
            label = f"{req_id}: {n} {what}" if n * cell > 7.2 * (len(what) + 8) else str(n)
            svg.text(x + n * cell / 2, y + 18, label, fill="#ffffff", anchor="middle")
            x += n * cell
        used = sum(n for _, n, _ in rows)
        if used < budget:
            svg.rect(x, y, (budget - used) * cell, 26, LIGHT)
        svg.text(left + budget * cell + 10, y + 18, f"{used}/{budget}", mono=True)
    axis_y = top + row_h * len(steps) + 14
    for t in range(0, budget + 1, 8):
        svg.text(left + t * cell, axis_y, str(t), anchor="middle", mono=True, fill=GREY)
    return svg.render()


# ------------------------------------------------------- shared blocks
def block_sharing(
    tables: Sequence[tuple[str, Sequence[int]]], ref_cnt: dict[int, int], title: str
) -> str:
    """Each request's block table (logical blocks) pointing at physical blocks,
    each physical block with its ref_cnt."""
    box_w, box_h, gap = 64, 28, 14
    left, top, row_h = 110, 40, 90
    physical = sorted({b for _, ids in tables for b in ids})
    px = 560
    height = max(top + row_h * len(tables), top + (box_h + 12) * len(physical)) + 20
    svg = Svg(px + 200, height, title)
    svg.text(left, 20, "block tables (logical block j)", bold=True)
    svg.text(px, 20, "physical blocks", bold=True)
    where: dict[int, float] = {}
    for k, block in enumerate(physical):
        y = top + k * (box_h + 12)
        where[block] = y + box_h / 2
        shared = ref_cnt.get(block, 0) > 1
        svg.rect(px, y, 180, box_h, CACHED if shared else LIGHT, stroke=GREY)
        svg.text(px + 10, y + 19, f"block {block}   ref_cnt {ref_cnt.get(block, 0)}", mono=True)
    # The pointers first, so that the boxes are drawn over them.
    for i, (req_id, ids) in enumerate(tables):
        for j, block in enumerate(ids):
            x, y = left + j * (box_w + gap) + box_w / 2, top + i * row_h + box_h / 2
            svg.line(x, y, px - 4, where[block], stroke=color(req_id))
    for i, (req_id, ids) in enumerate(tables):
        y = top + i * row_h
        svg.text(left - 12, y + 19, f"request {req_id}", anchor="end", fill=color(req_id))
        for j, block in enumerate(ids):
            x = left + j * (box_w + gap)
            svg.rect(x, y, box_w, box_h, color(req_id))
            svg.text(x + box_w / 2, y + 19, f"j={j}: {block}", fill="#ffffff", anchor="middle")
    return svg.render()


# ----------------------------------------------------------- free queue
def free_queue(
    panels: Sequence[tuple[str, dict[str, Sequence[int]], Sequence[tuple[int, bool]], str]],
    title: str,
) -> str:
    """Moments of the pool: who holds which blocks, and the free queue from
    its head (next to be handed out) to its tail, cached blocks marked."""
    box, gap, panel_h, qx = 46, 8, 118, 470
    longest = max((len(q) for _, _, q, _ in panels), default=0)
    width = max(760, qx + 130 + longest * (box + gap) + 10)
    svg = Svg(width, 30 + panel_h * len(panels), title)
    legend(svg, 18, [("free, still cached (a hit revives it)", CACHED), ("free, no hash", LIGHT)])
    for i, (caption, held, queue, note) in enumerate(panels):
        y = 44 + i * panel_h
        svg.text(10, y, caption, bold=True)
        row = y + 14
        for req_id, ids in held.items():
            svg.text(10, row + 19, f"request {req_id} holds", fill=color(req_id))
            for j, block in enumerate(ids):
                x = 140 + j * (box + gap)
                svg.rect(x, row, box, 26, color(req_id))
                svg.text(x + box / 2, row + 18, str(block), fill="#ffffff", anchor="middle")
            row += 30
        svg.text(qx, y + 33, "free queue: head →" if queue else "free queue: empty")
        for j, (block, cached) in enumerate(queue):
            x = qx + 130 + j * (box + gap)
            svg.rect(x, y + 14, box, 26, CACHED if cached else LIGHT, stroke=GREY)
            svg.text(x + box / 2, y + 32, str(block), anchor="middle")
        # The note under the queue, wrapped to the room right of it.
        for k, part in enumerate(textwrap.wrap(note, int((width - qx - 10) / CHAR_W))):
            svg.text(qx, y + 62 + 17 * k, part, fill=GREY)
    return svg.render()


# ------------------------------------------------------------- KV layout
def kv_layout(
    blocks: Sequence[int], block_size: int, filled: int, slot: int, shape: Sequence[int]
) -> str:
    """One layer's cache as blocks of ``block_size`` slots, K and V planes;
    ``filled`` tokens of one request in ``blocks``; ``slot`` resolved."""
    cell, left, top = 34, 150, 80
    rows = [0, *blocks]
    width = left + block_size * cell + 20
    svg = Svg(width, top + 70 * len(rows) + 30, "The paged KV cache")
    dims = "[num_blocks, 2, block_size, num_kv_heads, head_size]"
    svg.text(10, 20, f"kv_cache: {dims} = {list(shape)}", mono=True)
    svg.text(10, 40, "one cell = one slot: a token's K (or V), for every KV head", fill=GREY)
    legend(
        svg,
        64,
        [
            ("the null block", GREY),
            ("the prompt", color("0")),
            (f"slot {slot}: the next step's token", REQUEST_COLORS[2]),
            ("not written yet", LIGHT),
        ],
    )
    block_of, offset = divmod(slot, block_size)
    for r, block in enumerate(rows):
        y0 = top + r * 70
        for plane, name in enumerate(("K", "V")):
            y = y0 + plane * 30
            tag = " (null)" if block == 0 else ""
            svg.text(left - 8, y + 19, f"block {block}{tag} · {name}", anchor="end", mono=True)
            for o in range(block_size):
                s = block * block_size + o
                pos = blocks.index(block) * block_size + o if block in blocks else -1
                fill = GREY if block == 0 else (color("0") if 0 <= pos < filled else LIGHT)
                if s == slot:
                    fill = REQUEST_COLORS[2]
                svg.rect(left + o * cell, y, cell, 26, fill)
                if plane == 0:
                    ink = GREY if fill == LIGHT else "#ffffff"
                    svg.text(left + o * cell + cell / 2, y + 17, str(s), ink, "middle", True)
    y = top + len(rows) * 70 + 14
    svg.text(
        10,
        y,
        f"slot {slot} = block {block_of} · {block_size} + offset {offset}  →  "
        f"K in kv_cache[{block_of}, 0, {offset}], V in kv_cache[{block_of}, 1, {offset}]",
        mono=True,
    )
    return svg.render()


# ------------------------------------------------------------ causal mask
def causal_mask(q: int, seq_len: int) -> str:
    """A prefill chunk's mask: query i (position L - Q + i) sees keys 0 .. L - Q + i."""
    cell, left, top = 18, 120, 64
    ctx = seq_len - q
    svg = Svg(left + seq_len * cell + 20, top + q * cell + 60, "Bottom-right aligned causal mask")
    legend(
        svg,
        18,
        [
            (f"key in the cache from earlier steps (0 … {ctx - 1})", "#7986cb"),
            (f"key of this chunk ({ctx} … {seq_len - 1})", REQUEST_COLORS[2]),
            ("masked", LIGHT),
        ],
    )
    svg.text(left, top - 12, f"keys 0 … {seq_len - 1}  (L = {seq_len})", fill=GREY)
    for i in range(q):
        y = top + i * cell
        svg.text(left - 8, y + 13, f"q{i} @ {ctx + i}", anchor="end", mono=True)
        for j in range(seq_len):
            fill = LIGHT if j > ctx + i else ("#7986cb" if j < ctx else REQUEST_COLORS[2])
            svg.rect(left + j * cell, y, cell, cell, fill)
    y = top + q * cell + 18
    for j in range(0, seq_len, 4):
        svg.text(left + j * cell + cell / 2, y, str(j), anchor="middle", mono=True, fill=GREY)
    svg.text(
        left,
        y + 22,
        f"Q = {q} queries at positions {ctx} … {seq_len - 1}: query i sees keys 0 … {ctx} + i",
    )
    return svg.render()


# ------------------------------------------------------------ MoE routing
EXPERT_COLORS = [
    "#3f51b5", "#00897b", "#ef6c00", "#8e24aa", "#c62828", "#2e7d32", "#6d4c41", "#0277bd",
]  # fmt: skip


def moe_routing(
    probs: Sequence[Sequence[float]],
    topk_ids: Sequence[Sequence[int]],
    topk_weights: Sequence[Sequence[float]],
    sorted_token_ids: Sequence[int],
    expert_ids: Sequence[int],
    num_tokens_post_padded: int,
    block_size: int,
) -> str:
    """A MoE layer's routing: each token's softmax over the experts with its
    top-k marked, the kept weights renormalised, then the (token, k) rows
    grouped by expert in blocks of ``block_size`` rows, padding greyed.

    ``sorted_token_ids`` holds flattened rows ``t * top_k + k`` (``numel`` for
    padding), ``expert_ids`` one expert per block (-1: unused block).
    """
    num_tokens, num_experts = len(probs), len(probs[0])
    top_k = len(topk_ids[0])
    numel = num_tokens * top_k
    cell_w, cell_h, left, top = 46, 24, 50, 70
    grid_w = num_experts * cell_w
    wx = left + grid_w + 30  # the renormalised weights' column
    used_blocks = num_tokens_post_padded // block_size
    slot_w, block_gap = 56, 16
    blocks_top = top + num_tokens * cell_h + 86
    width = max(760, wx + 64 * top_k + 20, left + used_blocks * (slot_w + block_gap) + 20)
    height = blocks_top + 30 + block_size * cell_h + 60
    svg = Svg(width, height, "MoE routing: top-k, renormalised, grouped by expert")
    svg.text(10, 20, f"1. router: softmax over {num_experts} experts, top-{top_k} kept", bold=True)
    svg.text(wx, 20, "2. renormalised", bold=True)
    svg.text(wx, 38, "(each row sums to 1)", fill=GREY)
    for e in range(num_experts):
        svg.text(
            left + e * cell_w + cell_w / 2, top - 10, f"e{e}", EXPERT_COLORS[e], "middle", True
        )
    for t in range(num_tokens):
        y = top + t * cell_h
        svg.text(left - 8, y + 17, f"t{t}", anchor="end", mono=True)
        for e in range(num_experts):
            kept = e in topk_ids[t]
            svg.rect(left + e * cell_w, y, cell_w, cell_h, EXPERT_COLORS[e] if kept else LIGHT)
            ink = "#ffffff" if kept else GREY
            svg.text(
                left + e * cell_w + cell_w / 2, y + 17, f"{probs[t][e]:.2f}", ink, "middle", True
            )
        for k in range(top_k):
            e, w = topk_ids[t][k], topk_weights[t][k]
            x = wx + k * 64
            svg.rect(x, y, 60, cell_h, EXPERT_COLORS[e])
            svg.text(x + 30, y + 17, f"e{e} {w:.2f}", "#ffffff", "middle", True)
    counts = [sum(row.count(e) for row in topk_ids) for e in range(num_experts)]
    y = top + num_tokens * cell_h + 22
    svg.text(
        10,
        y,
        "tokens per expert: " + "  ".join(f"e{e}:{c}" for e, c in enumerate(counts)),
        mono=True,
    )
    svg.text(
        10,
        blocks_top - 30,
        f"3. moe_align_block_size: rows t·k grouped by expert, each run padded to {block_size}",
        bold=True,
    )
    for b in range(used_blocks):
        e = expert_ids[b]
        x = left + b * (slot_w + block_gap)
        svg.text(x + slot_w / 2, blocks_top - 10, f"block {b}", GREY, "middle", True)
        svg.text(x + slot_w / 2, blocks_top + 4, f"e{e}", EXPERT_COLORS[e], "middle", True)
        for i in range(block_size):
            row = sorted_token_ids[b * block_size + i]
            y = blocks_top + 12 + i * cell_h
            if row >= numel:
                svg.rect(x, y, slot_w, cell_h, LIGHT, stroke=GREY)
                svg.text(x + slot_w / 2, y + 17, "pad", GREY, "middle", True)
            else:
                svg.rect(x, y, slot_w, cell_h, EXPERT_COLORS[e])
                t, k = divmod(row, top_k)
                svg.text(x + slot_w / 2, y + 17, f"t{t}·{k}", "#ffffff", "middle", True)
    idle = [f"e{e}" for e, c in enumerate(counts) if c == 0]
    svg.text(
        10,
        height - 30,
        f"{numel} rows in {num_tokens_post_padded} slots ({used_blocks} blocks); "
        f"no block for {', '.join(idle) if idle else 'no expert'} (no tokens).",
        fill=GREY,
    )
    svg.text(
        10,
        height - 12,
        "The grouped GEMM runs one program per block: one expert's weights.",
        fill=GREY,
    )
    return svg.render()
