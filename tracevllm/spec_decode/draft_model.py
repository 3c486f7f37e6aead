"""Drafts from a second, smaller model, run k times after each target step.

Mirrors vllm/v1/spec_decode/draft_model.py (``DraftModelProposer``) with the
parts of vllm/v1/spec_decode/llm_base_proposer.py (``SpecDecodeBaseProposer``: ``propose``,
``prepare_inputs``, ``_sample_draft_tokens``) and of its
``compute_probs_and_sample_next_token`` that a draft model uses, on the
unpadded path (vLLM's ``disable_padded_drafter_batch``): rejected drafts are
left out of the draft's inputs rather than masked.

The draft model is loaded through the same loader as the target and has its
own attention layers (named ``draft_model.model.layers.N...``) and KV cache
tensors, but shares the target's block table: the same block ids index both
caches, so the scheduler allocates for one and both fit (vLLM puts the
draft's layers in the target's KV cache group the same way, which is why a
block costs the bytes of both models). A draft model writes k slots past the
tokens it was given; the scheduler reserves them (``num_lookahead_tokens``).

Each step the draft model sees exactly the tokens the target model kept, so
its cache stays in step with the target's:

1. one pass over each request's tokens of this step, minus its rejected
   drafts, plus the token the target emitted last; its logits at that last
   token give draft 1;
2. k - 1 passes of one token per request, each feeding the last draft back.

A request in a partial prefill only runs pass 1 (for its KV) and gets no
drafts; neither does one whose drafts would pass the draft's
``max_model_len``. That limit is per request here; vLLM's is batch-wide
(``input_fits_in_drafter`` in gpu_model_runner.py: when the longest request
plus k would pass it, no request drafts that step), so near the limit
tracevllm drafts for the requests that still fit. Left out: CUDA graphs, the
padded batch and its Triton kernels, draft tensor parallelism, parallel
drafting, EAGLE's hidden states.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np
import torch

from tracevllm.attention.backends.abstract import AttentionMetadata
from tracevllm.forward_context import set_forward_context
from tracevllm.model_executor.layers.attention import Attention
from tracevllm.model_executor.model_loader import get_model

if TYPE_CHECKING:
    from tracevllm.config import VllmConfig
    from tracevllm.model_executor.models.interfaces_base import VllmModelForTextGeneration
    from tracevllm.sample.metadata import SamplingMetadata
    from tracevllm.worker.input_batch import InputBatch

# Below this temperature a request's drafts are greedy (the sampler's _SAMPLING_EPS).
_SAMPLING_EPS = 1e-5


@dataclasses.dataclass(slots=True)
class DraftInputs:
    """The draft model's first pass: which rows, which tokens, where."""

    # Batch rows in the pass, and which of them will draft.
    rows: list[int]
    drafting: list[bool]
    # [num_tokens]: the tokens and their positions, row after row.
    input_ids: list[int]
    positions: list[int]
    # [len(rows)]: tokens of each row in the pass.
    num_tokens: list[int]


class DraftModelProposer:
    def __init__(self, vllm_config: VllmConfig, device: torch.device) -> None:
        spec = vllm_config.speculative_config
        assert spec is not None and spec.draft_model_config is not None
        assert spec.num_speculative_tokens is not None
        self.vllm_config = vllm_config
        self.speculative_config = spec
        # vLLM's _create_draft_vllm_config: the target's, with the draft's model.
        self.draft_vllm_config = dataclasses.replace(
            vllm_config, model_config=spec.draft_model_config
        )
        self.device = device
        self.num_speculative_tokens = spec.num_speculative_tokens
        self.max_model_len = spec.draft_model_config.get_max_model_len()
        self.block_size = vllm_config.cache_config.block_size
        self.probabilistic = spec.draft_sample_method == "probabilistic"
        self.model: VllmModelForTextGeneration | None = None
        self.attn_layers: dict[str, Attention] = {}
        # The probabilities of the last drafts, by request (probabilistic only).
        self.last_draft_probs: dict[str, torch.Tensor] = {}

    def load_model(self) -> None:
        self.model = get_model(self.draft_vllm_config, prefix="draft_model")
        self.attn_layers = {
            m.layer_name: m for m in self.model.modules() if isinstance(m, Attention)
        }

    # --8<-- [start:draft_propose]
    @torch.inference_mode()
    def propose(
        self,
        sampled_token_ids: list[list[int]],  # per row: this step's emitted tokens
        input_batch: InputBatch,
        num_scheduled_tokens: np.ndarray,  # [num_reqs]: this step's tokens per row
        num_draft_tokens: list[int],  # [num_reqs]: this step's drafts per row
        sampling_metadata: SamplingMetadata,
    ) -> list[list[int]]:
        """Drafts per row of the batch (none for a row that cannot draft)."""
        self.last_draft_probs = {}
        inputs = self.prepare_inputs(
            sampled_token_ids, input_batch, num_scheduled_tokens, num_draft_tokens
        )
        drafts: list[list[int]] = [[] for _ in sampled_token_ids]
        if not inputs.rows:
            return drafts
        rows = np.array(inputs.rows)
        positions = np.array(inputs.positions)
        query_lens = np.array(inputs.num_tokens)
        # Pass 1: every kept token of the step, and the last emitted one.
        hidden_states = self._run(input_batch, rows, inputs.input_ids, positions, query_lens)
        last = np.cumsum(query_lens) - 1  # the last token of each row
        keep = np.nonzero(np.array(inputs.drafting, dtype=bool))[0]
        if keep.size == 0:
            return drafts
        rows, positions = rows[keep], positions[last[keep]]
        temperature = self._row_temperatures(sampling_metadata, rows)
        token_ids, probs = self._sample_draft_tokens(hidden_states[last[keep]], temperature)
        draft_token_ids: list[torch.Tensor] = [token_ids]
        draft_probs: list[torch.Tensor | None] = [probs]
        # Passes 2..k: one token per row, the draft just made.
        ones = np.ones(len(rows), dtype=np.int64)
        for _ in range(self.num_speculative_tokens - 1):
            positions = positions + 1
            hidden_states = self._run(
                input_batch, rows, draft_token_ids[-1].tolist(), positions, ones
            )
            token_ids, probs = self._sample_draft_tokens(hidden_states, temperature)
            draft_token_ids.append(token_ids)
            draft_probs.append(probs)
        stacked = torch.stack(draft_token_ids, dim=1).tolist()  # [len(rows), k]
        for i, row in enumerate(rows.tolist()):
            drafts[row] = stacked[i]
            if all(p is not None for p in draft_probs):
                req_id = input_batch.req_ids[row]
                self.last_draft_probs[req_id] = torch.stack(
                    [p[i] for p in draft_probs if p is not None]
                )
        return drafts

    # --8<-- [end:draft_propose]

    # --8<-- [start:draft_prepare_inputs]
    def prepare_inputs(
        self,
        sampled_token_ids: list[list[int]],
        input_batch: InputBatch,
        num_scheduled_tokens: np.ndarray,
        num_draft_tokens: list[int],
    ) -> DraftInputs:
        """Each row's tokens for pass 1, from the persistent batch.

        After the bookkeeping ``token_ids_cpu`` holds the emitted tokens where
        the drafts were, so a row's kept tokens are simply those from its
        first position this step up to its new length: the rejected drafts
        are gone, the last emitted token is the extra one at the end. A
        partial prefill (nothing emitted) gives its chunk and no drafts.
        """
        k = self.num_speculative_tokens
        inputs = DraftInputs([], [], [], [], [])
        for row, emitted in enumerate(sampled_token_ids):
            start = int(input_batch.num_computed_tokens_cpu[row])
            if emitted:
                end = int(input_batch.num_tokens_no_spec[row])
                # The step's real tokens, then what it emitted.
                assert end == start + num_scheduled_tokens[row] - num_draft_tokens[row] + len(
                    emitted
                ), "the persistent batch is out of step"
            else:
                end = start + int(num_scheduled_tokens[row])
            if end > self.max_model_len:
                continue  # past what the draft model can read: no drafts from here on
            inputs.rows.append(row)
            # Its k drafts would sit at end .. end + k - 1.
            inputs.drafting.append(bool(emitted) and end + k <= self.max_model_len)
            inputs.input_ids += input_batch.token_ids_cpu[row, start:end].tolist()
            inputs.positions += range(start, end)
            inputs.num_tokens.append(end - start)
        return inputs

    # --8<-- [end:draft_prepare_inputs]

    def _run(
        self,
        input_batch: InputBatch,
        rows: np.ndarray,  # [num_rows]: batch rows in the pass
        input_ids: list[int],  # [num_tokens]
        positions: np.ndarray,  # [num_tokens]
        query_lens: np.ndarray,  # [num_rows]
    ) -> torch.Tensor:
        """One forward of the draft model; [num_tokens, hidden_size]."""
        assert self.model is not None, "load_model() first"
        bs = self.block_size
        req_indices = np.repeat(rows, query_lens)  # [num_tokens]: batch row of each token
        block_table = input_batch.block_table[0].get_numpy_array()  # the one KV cache group
        # The draft's cache shares the target's block ids (the slot rule of compute_slot_mapping).
        slot_mapping = (
            block_table[req_indices, positions // bs].astype(np.int64) * bs + positions % bs
        )
        query_start_loc = np.zeros(len(rows) + 1, dtype=np.int32)
        query_start_loc[1:] = np.cumsum(query_lens)
        # Each row's last position + 1: what is in the cache after this pass.
        seq_lens = (positions[query_start_loc[1:] - 1] + 1).astype(np.int32)
        max_seq_len = int(seq_lens.max())
        qsl_cpu, seq_lens_cpu = torch.from_numpy(query_start_loc), torch.from_numpy(seq_lens)
        dev = self.device
        metadata = AttentionMetadata(
            num_actual_tokens=len(input_ids),
            max_query_len=int(query_lens.max()),
            query_start_loc=qsl_cpu.to(dev),
            max_seq_len=max_seq_len,
            seq_lens=seq_lens_cpu.to(dev),
            block_table=torch.from_numpy(block_table[rows, : -(-max_seq_len // bs)]).to(dev),
            slot_mapping=torch.from_numpy(slot_mapping).to(dev),
            query_start_loc_cpu=qsl_cpu,
            seq_lens_cpu=seq_lens_cpu,
        )
        with set_forward_context(
            dict.fromkeys(self.attn_layers, metadata),
            self.draft_vllm_config,
            no_compile_layers=dict(self.attn_layers),
            slot_mapping=dict.fromkeys(self.attn_layers, metadata.slot_mapping),
        ):
            return self.model(
                torch.tensor(input_ids, dtype=torch.int64, device=dev),
                torch.from_numpy(positions.astype(np.int64)).to(dev),
            )

    @staticmethod
    def _row_temperatures(md: SamplingMetadata, rows: np.ndarray) -> torch.Tensor | None:
        """The temperatures of the drafting rows (None: all greedy)."""
        if md.all_greedy or md.temperature is None:
            return None
        return md.temperature[torch.from_numpy(rows)]

    def _sample_draft_tokens(
        self, hidden_states: torch.Tensor, temperature: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Greedy drafts (vLLM's default), or drawn at the request's
        temperature with their probabilities kept for the rejection sampler.

        Only the temperature is applied (not top-k/top-p, nor the seed), as
        vLLM: q is the distribution the draft was actually drawn from, so
        the rejection rule stays exact whatever q is.
        """
        assert self.model is not None
        logits = self.model.compute_logits(hidden_states)  # [num_rows, vocab_size]
        if not self.probabilistic or temperature is None:
            return logits.argmax(dim=-1), None
        is_greedy = temperature < _SAMPLING_EPS
        logits = logits.div_(torch.where(is_greedy, 1.0, temperature).unsqueeze(1))
        probs = logits.softmax(dim=-1, dtype=torch.float32)
        q = torch.empty_like(probs).exponential_()
        next_token_ids = probs.div(q).argmax(dim=-1)
        return torch.where(is_greedy, probs.argmax(dim=-1), next_token_ids), probs
