"""The KV cache, structured-outputs and PagedAttention chapters' mechanism
diagrams, drawn as SVG from the recorded runs' numbers
(docs/record_assets.py, docs/record_structured.py): the block-hash chain, the
token regions of ``allocate_slots``, the token bitmask's words, and the
attention kernel's walk over a block table. The drawing primitives are
docs/diagrams.py's.
"""

from __future__ import annotations

from collections.abc import Sequence

from diagrams import (
    ACCEPT,
    CACHED,
    CHAR_W,
    GREY,
    INK,
    LIGHT,
    REJECT,
    REQUEST_COLORS,
    Svg,
    color,
    legend,
)


# ------------------------------------------------------------- block hashes
def hash_chain(
    rows: Sequence[tuple[str, Sequence[tuple[str, str, str, int | None]], str]],
    none_hash: str,
) -> str:
    """Each request's full blocks as a chain: block j's hash is the hash of
    (block j − 1's hash, its 16 token ids, extra_keys); a block whose hash a
    row above already has is a prefix hit.

    ``rows``: (request, [(tokens as text, parent hash, hash, physical block)],
    what follows the last full block).
    """
    box_w, box_h, left, top, row_h = 250, 92, 120, 50, 150
    n = max(len(blocks) for _, blocks, _ in rows)
    width = left + n * (box_w + 40) + 10
    svg = Svg(max(width, 760), top + row_h * len(rows), "The block-hash chain")
    svg.text(
        10,
        20,
        "hash(block j) = sha256(pickle((hash(block j−1), its 16 token ids, extra_keys)))",
        mono=True,
    )
    svg.text(10, 38, f"block 0's parent: NONE_HASH = {none_hash}…", fill=GREY, mono=True)
    seen: dict[str, str] = {}
    for r, (req_id, blocks, tail) in enumerate(rows):
        y = top + r * row_h
        svg.text(left - 12, y + 20, f"request {req_id}", anchor="end", fill=color(req_id))
        for j, (tokens, parent, h, block) in enumerate(blocks):
            x = left + j * (box_w + 40)
            hit = h in seen
            svg.rect(x, y, box_w, box_h, CACHED if hit else LIGHT, stroke=color(req_id))
            where = f" → block {block}" if block is not None else ""
            svg.text(x + 8, y + 18, f"logical block {j}{where}", bold=True)
            svg.text(x + 8, y + 38, f"parent {parent}…", mono=True)
            svg.text(x + 8, y + 56, tokens, mono=True, fill=GREY)
            svg.text(x + 8, y + 74, "extra_keys None", mono=True, fill=GREY)
            svg.text(x + 8, y + 108, f"hash {h}…", mono=True, bold=True)
            if hit:
                svg.text(x + box_w, y + 126, f"= request {seen[h]}'s: a hit", anchor="end")
            seen.setdefault(h, req_id)
            if j + 1 < len(blocks):
                svg.line(x + box_w, y + box_h / 2, x + box_w + 38, y + box_h / 2)
        svg.text(left + (len(blocks) - 1) * (box_w + 40), y + box_h + 34, tail, fill=GREY)
    return svg.render()


# --------------------------------------------------------- allocate_slots
REGIONS = [
    ("computed", "#5c6bc0"),
    ("prefix hits", CACHED),
    ("new", REQUEST_COLORS[1]),
    ("lookahead", "#ce93d8"),
]


def slot_regions(
    calls: Sequence[tuple[str, Sequence[int], Sequence[int], Sequence[int]]],
    block_size: int,
) -> str:
    """Calls of allocate_slots, one bar each over the request's token
    positions: computed | prefix hits | new | lookahead, block boundaries
    marked, and the blocks the call returned.

    ``calls``: (caption, the four region sizes, the request's block ids
    after the call, the block ids the call returned).
    """
    cell, left, top, row_h = 12, 20, 54, 110
    span = max(sum(sizes) for _, sizes, _, _ in calls)
    num_blocks = -(-span // block_size)
    width = max(760, left + num_blocks * block_size * cell + 20)
    svg = Svg(width, top + row_h * len(calls) + 10, "The token regions of allocate_slots")
    legend(svg, 18, [(name, fill) for name, fill in REGIONS] + [("no slot yet", LIGHT)])
    for c, (caption, sizes, held, returned) in enumerate(calls):
        y = top + c * row_h
        svg.text(left, y + 8, caption, bold=True)
        x0, pos = left, 0
        for (name, fill), n in zip(REGIONS, sizes):
            if n:
                svg.rect(x0 + pos * cell, y + 18, n * cell, 26, fill, stroke=fill)
                label = f"{name} {pos}–{pos + n - 1}" if n > 1 else f"{name} {pos}"
                if len(label) * CHAR_W > n * cell:
                    label = str(n)
                ink = INK if fill in (CACHED, "#ce93d8") else "#ffffff"
                svg.text(x0 + (pos + n / 2) * cell, y + 36, label, ink, "middle")
            pos += n
        end = num_blocks * block_size
        if pos < end:
            svg.rect(x0 + pos * cell, y + 18, (end - pos) * cell, 26, LIGHT, stroke=LIGHT)
        for b in range(num_blocks):
            x = x0 + b * block_size * cell
            svg.parts.append(
                f'<line x1="{x:.1f}" y1="{y + 14}" x2="{x:.1f}" y2="{y + 48}" stroke="{INK}"/>'
            )
            block = held[b] if b < len(held) else None
            name = f"block {block}" if block is not None else "no block"
            mark = " (new)" if block in returned else ""
            svg.text(x + 4, y + 62, f"j={b}: {name}{mark}", mono=True)
        svg.text(
            left,
            y + 82,
            f"returned {list(returned)}: the blocks this call added",
            fill=GREY,
        )
    return svg.render()


# ------------------------------------------------------------ token bitmask
def bitmask_words(
    panels: Sequence[tuple[str, int, int, Sequence[tuple[int, str]]]],
    summary: Sequence[str],
) -> str:
    """Words of a grammar's token bitmask, 32 bits each, drawn as the binary
    number (bit 31, the sign bit, on the left): bit b of word w is token
    32·w + b, allowed when set.

    ``panels``: (caption, word index, the word as int32, [(token, its text)]
    to point at); ``summary``: lines under the words.
    """
    cell, left, top, panel_h = 20, 70, 30, 150
    width = max(760, left + 32 * cell + 20)
    svg = Svg(width, top + panel_h * len(panels) + 20 * len(summary) + 20, "The token bitmask")
    legend(svg, 18, [("bit set: token allowed", ACCEPT), ("bit clear: −∞", LIGHT)])
    for k, (caption, word, value, marked) in enumerate(panels):
        y = top + 24 + k * panel_h
        unsigned = value & 0xFFFFFFFF
        svg.text(10, y, caption, bold=True)
        svg.text(
            10,
            y + 20,
            f"word {word} = {value} (0x{unsigned:08x}): tokens {32 * word} … {32 * word + 31}",
            mono=True,
        )
        row = y + 34
        svg.text(left - 8, row + 15, f"w{word}", anchor="end", mono=True)
        for b in range(31, -1, -1):
            x = left + (31 - b) * cell
            on = (unsigned >> b) & 1
            svg.rect(x, row, cell, 22, ACCEPT if on else LIGHT, stroke=GREY)
            svg.text(x + cell / 2, row + 15, str(on), "#ffffff" if on else GREY, "middle", True)
            if b % 4 == 3 or b == 0:
                svg.text(x + cell / 2, row + 36, str(b), GREY, "middle", True)
        svg.text(left - 8, row + 36, "bit", anchor="end", fill=GREY)
        sign = "set: the word is negative" if unsigned >> 31 else "clear"
        ink = REJECT if unsigned >> 31 else GREY
        svg.text(left, row + 54, f"bit 31, the sign bit: {sign}", fill=ink)
        notes = [
            f"token {t} {text}: word {t // 32}, bit {t % 32}"
            for t, text in marked
            if t // 32 == word
        ]
        if notes:
            svg.text(left, row + 72, "; ".join(notes), mono=True)
        for t, _ in marked:
            if t // 32 == word:
                x = left + (31 - t % 32) * cell
                svg.rect(x, row - 3, cell, 28, "none", stroke=REJECT)
    y = top + 24 + panel_h * len(panels)
    for k, line in enumerate(summary):
        svg.text(10, y + 20 * k, line, fill=GREY)
    return svg.render()


# ------------------------------------------------------- the kernel's walk
BLOCK_COLORS = ["#5c6bc0", "#26a69a", "#ffa726", "#ab47bc", "#ef5350", "#8d6e63", "#29b6f6"]


def tile_walk(
    programs: Sequence[tuple[str, int, int, Sequence[int]]],
    block_size: int,
    tile_size: int,
) -> str:
    """Programs of kernel_unified_attention, each walking its request's
    block-table row ``tile_size`` keys at a time: key position s is read from
    physical block ``row[s // block_size]``, row ``s % block_size``; keys
    past the program's last query (causal) or past the row are masked.

    ``programs``: (caption, first query position, last query position, the
    request's block-table row).
    """
    cell, left, top, prog_h = 10, 20, 40, 118
    num_tiles_max = max(-(-(last + 1) // tile_size) for _, _, last, _ in programs)
    keys = num_tiles_max * tile_size
    width = max(760, left + keys * cell + 20)
    svg = Svg(width, top + prog_h * len(programs) + 20, "The kernel's walk over a block table")
    svg.text(
        10,
        20,
        f"each program: one query block × one KV head; keys {tile_size} at a time (TILE_SIZE), "
        f"blocks of {block_size}",
        bold=True,
    )
    for k, (caption, _first, last, row) in enumerate(programs):
        y = top + k * prog_h
        svg.text(left, y + 14, caption)
        # The kernel's bound: keys up to the program's last query position.
        num_tiles = -(-(last + 1) // tile_size)
        for s in range(num_tiles * tile_size):
            j = s // block_size
            valid = s <= last and j < len(row)
            fill = BLOCK_COLORS[row[j] % len(BLOCK_COLORS)] if valid else LIGHT
            svg.rect(left + s * cell, y + 24, cell, 22, fill, stroke="#ffffff")
        for s in range(num_tiles * tile_size, keys):
            svg.rect(left + s * cell, y + 24, cell, 22, "#ffffff", stroke=LIGHT)
        for t in range(num_tiles + 1):
            x = left + t * tile_size * cell
            svg.parts.append(
                f'<line x1="{x:.1f}" y1="{y + 20}" x2="{x:.1f}" y2="{y + 50}" '
                f'stroke="{INK}" stroke-width="2"/>'
            )
            if t < num_tiles:
                label = f"tile {t}: keys {t * tile_size}–{(t + 1) * tile_size - 1}"
                svg.text(x + 4, y + 62, label, mono=True)
        for j in range(-(-(num_tiles * tile_size) // block_size)):
            x = left + j * block_size * cell
            name = f"row[{j}] = {row[j]}" if j < len(row) else f"row[{j}]: none"
            svg.text(x + 2, y + 78, name, GREY, mono=True)
        masked = num_tiles * tile_size - min(last + 1, len(row) * block_size)
        svg.text(
            left,
            y + 98,
            f"{num_tiles} tile(s); {masked} key slots past position {last} masked; "
            "M, L, acc rescaled per tile",
            fill=GREY,
        )
    return svg.render()
