"""Draw the model-families chapter's MoE routing from the engine's own functions.

``docs/record_assets.py`` calls ``draw()`` with the book's other recordings;
``python docs/record_moe.py`` redraws this one alone, updating the ``moe``
entry of ``facts.json`` and leaving the other recordings as they are.

Nothing is run but the routing itself: seeded router logits for 6 tokens
over 8 experts go through ``fused_topk`` (softmax, top-2, renormalised, as
Qwen3-MoE's ``norm_topk_prob``) and ``moe_align_block_size`` (blocks of 4
rows, small enough to draw; the kernel's ``BLOCK_SIZE_M`` is 16 for so few
tokens). tests/test_docs.py recomputes them and compares with the recorded
figures, so a change to either function shows up as a stale figure.
"""

from __future__ import annotations

import os
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "docs"))

import diagrams  # noqa: E402  (docs/, beside this file)

NAME = "moe"
NUM_TOKENS, NUM_EXPERTS, TOP_K, BLOCK_SIZE, SEED = 6, 8, 2, 4, 0


def routing() -> dict[str, Any]:
    """The routing of the seeded example, as plain lists (what facts.json keeps)."""
    import torch

    from tracevllm.model_executor.layers.fused_moe import fused_topk, moe_align_block_size

    gen = torch.Generator().manual_seed(SEED)
    # [num_tokens, num_experts]: the gate's logits, spread as a trained router's are.
    logits = torch.randn(NUM_TOKENS, NUM_EXPERTS, generator=gen) * 1.5
    hidden = torch.zeros(NUM_TOKENS, 1)  # fused_topk reads only its token count
    weights, ids, _ = fused_topk(hidden, logits, TOP_K, renormalize=True)
    sorted_ids, expert_ids, post_padded = moe_align_block_size(ids, BLOCK_SIZE, NUM_EXPERTS)
    probs = torch.softmax(logits, dim=-1)
    return {
        "num_tokens": NUM_TOKENS,
        "num_experts": NUM_EXPERTS,
        "top_k": TOP_K,
        "block_size": BLOCK_SIZE,
        "probs": [[round(p, 2) for p in row] for row in probs.tolist()],
        "topk_ids": ids.tolist(),
        "topk_weights": [[round(w, 2) for w in row] for row in weights.tolist()],
        "tokens_per_expert": torch.bincount(ids.flatten().long(), minlength=NUM_EXPERTS).tolist(),
        "sorted_token_ids": sorted_ids.tolist(),
        "expert_ids": expert_ids.tolist(),
        "num_tokens_post_padded": int(post_padded.item()),
    }


def draw() -> dict[str, Any]:
    import record_assets as assets  # docs/, beside this file

    facts = routing()
    assets.write_text(
        "moe-routing.svg",
        diagrams.moe_routing(
            facts["probs"],
            facts["topk_ids"],
            facts["topk_weights"],
            facts["sorted_token_ids"],
            facts["expert_ids"],
            facts["num_tokens_post_padded"],
            facts["block_size"],
        ),
    )
    return facts


def main() -> None:
    import record_assets as assets

    assets.rerecord_alone(__doc__, NAME, lambda: None, draw)


if __name__ == "__main__":
    main()
