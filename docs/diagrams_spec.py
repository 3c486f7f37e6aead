"""The speculative-decoding chapter's diagrams, drawn as SVG from the
recorded run's numbers (docs/record_spec.py): the verify step, p against q
with min(p, q) and max(p − q, 0), and ``_calc_spec_decode_metadata``'s
output over the flat batch. The drawing primitives are docs/diagrams.py's.
"""

from __future__ import annotations

from collections.abc import Sequence

from diagrams import (
    ACCEPT,
    BONUS,
    CHAR_W,
    GREY,
    INK,
    LIGHT,
    REJECT,
    Svg,
    color,
    legend,
)

# ------------------------------------------------------ speculative decoding


def verify_step(
    step: int,
    req_id: str,
    positions: Sequence[int],
    inputs: Sequence[str],
    logits_rows: Sequence[int],
    drafts: Sequence[str],
    accepted: int,
    next_token: str,
    bonus: bool,
) -> str:
    """One request's verify step: the last sampled token and k drafts at
    positions p … p+k, one logits row per position, the target's pick at each
    (greedy: its argmax) against the draft after it, and what went out."""
    k = len(drafts)
    col, left, top, row_h = 118, 190, 58, 30
    svg = Svg(left + col * (k + 1) + 10, top + row_h * 7 + 70, "The verify step")
    svg.text(
        10,
        20,
        f"Step {step}, request {req_id}: the last token and {k} drafts, one forward pass",
        bold=True,
    )
    legend(
        svg,
        42,
        [("draft kept", ACCEPT), ("rejected", REJECT), ("bonus", BONUS), ("not looked at", LIGHT)],
    )
    labels = [
        "position",
        "token in the batch",
        "logits row",
        "predicts position",
        "target's pick (argmax)",
        "draft at that position",
        "verdict",
    ]
    for r, label in enumerate(labels):
        svg.text(left - 10, top + r * row_h + 19, label, anchor="end")
    for i in range(k + 1):
        x = left + i * col
        is_draft_row = i < k
        if i < accepted:
            verdict, fill, pick = "✓ kept", ACCEPT, drafts[i]
        elif i == accepted:
            pick = next_token
            if bonus:
                verdict, fill = "bonus token", BONUS
            else:
                verdict, fill = "✗ → recovered", REJECT
        else:
            verdict, fill, pick = "—", LIGHT, "—"
        cells = [
            (str(positions[i]), LIGHT, INK),
            (inputs[i], color(req_id) if i else GREY, "#ffffff"),
            (str(logits_rows[i]), LIGHT, INK),
            (str(positions[i] + 1), LIGHT, INK),
            (pick, fill if fill != LIGHT else LIGHT, "#ffffff" if fill != LIGHT else GREY),
            (drafts[i] if is_draft_row else "(none: past the drafts)", LIGHT, INK),
            (verdict, fill, "#ffffff" if fill != LIGHT else GREY),
        ]
        for r, (s, bg, ink) in enumerate(cells):
            y = top + r * row_h
            svg.rect(x, y, col - 4, row_h - 4, bg)
            mono = r in (0, 2, 3)
            shown = s if len(s) * CHAR_W < col - 10 else s[: int((col - 16) / CHAR_W)] + "…"
            svg.text(x + (col - 4) / 2, y + 18, shown, ink, "middle", mono)
    y = top + row_h * 7 + 20
    emitted = [*drafts[:accepted], next_token]
    svg.text(10, y, f"emitted: {' '.join(emitted)}  ({len(emitted)} tokens from one pass)")
    if accepted < k:
        svg.text(
            10,
            y + 20,
            f"rolled back: num_computed_tokens −{k - accepted} "
            f"(the KV of positions {positions[accepted + 1]}…{positions[k]} is overwritten later)",
            fill=GREY,
        )
    return svg.render()


def accept_reject_bars(
    panels: Sequence[tuple[str, Sequence[str], Sequence[float], Sequence[float], str]],
) -> str:
    """p against q over a few tokens, per panel: min(p, q), the mass a draft
    drawn from q is accepted with, and max(p − q, 0), what a rejection
    draws the recovered token from (normalized).

    ``panels``: (title, token labels, p, q, the draft's label).
    """
    bar, gap, left, plot_h = 26, 30, 60, 150
    n = max(len(t) for _, t, _, _, _ in panels)
    width = max(760, left + n * (2 * bar + gap) + 20)
    panel_h = plot_h + 110
    svg = Svg(width, 52 + panel_h * len(panels), "Rejection sampling: p against q")
    legend(
        svg,
        18,
        [
            ("q (draft)", "#ffcc80"),
            ("min(p, q): accepted", ACCEPT),
            ("max(p − q, 0): recovered from", REJECT),
        ],
    )
    svg.text(
        10,
        36,
        "each token's left bar is p (target): green up to min(p, q), red above it",
        fill=GREY,
    )
    for k, (title, tokens, p, q, draft) in enumerate(panels):
        y0 = 60 + k * panel_h
        svg.text(10, y0 + 10, title, bold=True)
        base = y0 + 26 + plot_h
        top = max(max(p), max(q), 1e-9)
        scale = plot_h / top
        svg.parts.append(
            f'<line x1="{left - 4}" y1="{base:.1f}" x2="{width - 10}" y2="{base:.1f}" '
            f'stroke="{GREY}"/>'
        )
        for i, tok in enumerate(tokens):
            x = left + i * (2 * bar + gap)
            hp, hq = p[i] * scale, q[i] * scale
            svg.rect(x, base - hp, bar, hp, "#90caf9", stroke="#90caf9")
            svg.rect(x + bar, base - hq, bar, hq, "#ffcc80", stroke="#ffcc80")
            lo = min(p[i], q[i]) * scale
            svg.rect(x, base - lo, bar, lo, ACCEPT, stroke=ACCEPT)
            over = max(p[i] - q[i], 0) * scale
            if over > 0:
                svg.rect(x, base - hp, bar, over, REJECT, stroke=REJECT)
            svg.text(x + bar, base + 16, tok, anchor="middle", mono=True, bold=tok == draft)
            svg.text(x + bar, base + 30, f"p {p[i]:.2f}", anchor="middle", mono=True, fill=GREY)
            svg.text(x + bar, base + 44, f"q {q[i]:.2f}", anchor="middle", mono=True, fill=GREY)
        accept = sum(min(a, b) for a, b in zip(p, q))
        svg.text(
            10,
            base + 68,
            f"over these tokens: accepted with Σ min(p, q) = {accept:.2f}; "
            f"rejected with Σ max(p − q, 0) = {sum(max(a - b, 0) for a, b in zip(p, q)):.2f}",
            fill=GREY,
        )
    return svg.render()


def spec_metadata(
    num_scheduled: Sequence[int],
    num_drafts: Sequence[int],
    logits_indices: Sequence[int],
    target_logits_indices: Sequence[int],
    bonus_logits_indices: Sequence[int],
) -> str:
    """_calc_spec_decode_metadata's output over the flat batch: which tokens get
    a logits row, and which rows verify a draft or give the bonus token."""
    cell, left, top, gap = 28, 20, 84, 24
    total = sum(num_scheduled)
    # A long request is drawn with its middle folded: its first and last cells.
    groups: list[list[int | None]] = []
    start = 0
    for n in num_scheduled:
        idx = list(range(start, start + n))
        groups.append(list(idx) if n <= 8 else [*idx[:2], None, *idx[-4:]])
        start += n
    width = left + cell * sum(len(g) for g in groups) + gap * len(groups) + 20
    svg = Svg(max(width, 760), top + 190, "_calc_spec_decode_metadata")
    svg.text(
        10,
        20,
        f"scheduled {list(num_scheduled)} tokens, of which {list(num_drafts)} drafts "
        f"(a flat batch of {total})",
        bold=True,
    )
    legend(svg, 42, [("token with a logits row", "#7986cb"), ("no logits row", LIGHT)])
    where: dict[int, float] = {}
    x = left
    for r, group in enumerate(groups):
        svg.text(x, top - 26, f"request {r}", fill=color(str(r)), bold=True)
        svg.text(x, top - 9, f"{num_drafts[r]} drafts", fill=color(str(r)))
        for t in group:
            if t is None:
                svg.text(x + cell / 2, top + 18, "…", anchor="middle")
                x += cell
                continue
            has_row = t in logits_indices
            svg.rect(x, top, cell, 26, "#7986cb" if has_row else LIGHT, stroke=color(str(r)))
            ink = "#ffffff" if has_row else GREY
            svg.text(x + cell / 2, top + 17, str(t), ink, "middle", True)
            where[t] = x + cell / 2
            x += cell
        x += gap
    # Each logits row under the token it is computed from.
    y = top + 62
    svg.text(left, y - 12, "logits rows (row i is computed at token logits_indices[i]):", GREY)
    for row, t in enumerate(logits_indices):
        fill = BONUS if row in bonus_logits_indices else ACCEPT
        svg.rect(where[t] - cell / 2, y, cell, 26, fill)
        svg.text(where[t], y + 17, str(row), "#ffffff", "middle", True)
    legend(
        svg,
        y + 50,
        [("target row: verifies a draft", ACCEPT), ("bonus row: after the last token", BONUS)],
        x=left,
    )
    lines = [
        f"logits_indices        = {list(logits_indices)}",
        f"target_logits_indices = {list(target_logits_indices)}",
        f"bonus_logits_indices  = {list(bonus_logits_indices)}",
    ]
    for k, line in enumerate(lines):
        svg.text(left, y + 80 + 18 * k, line, mono=True)
    return svg.render()
