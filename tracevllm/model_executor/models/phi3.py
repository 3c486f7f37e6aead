"""Phi-3: Llama with q/k/v and gate/up fused in the checkpoint, and LongRoPE.

Mirrors vllm/model_executor/models/phi3.py: ``Phi3ForCausalLM`` is
``LlamaForCausalLM`` with its own ``packed_modules_mapping``. What differs
from Llama lives elsewhere:

- the checkpoint stores ``qkv_proj`` and ``gate_up_proj`` already stacked, so
  ``LlamaModel.load_weights`` finds no ``q_proj``/``gate_proj`` to map and hands
  each whole tensor to its parameter's ``weight_loader`` with no shard id;
  ``QKVParallelLinear`` / ``MergedColumnParallelLinear`` split it into q, k, v
  (gate, up) and keep this rank's heads (rows) of each;
- ``rope_parameters.rope_type == "longrope"`` makes ``get_rope`` build a
  ``Phi3LongRoPEScaledRotaryEmbedding`` (short and long rescale factors, an
  attention factor on cos/sin, partial rotary dims for Phi-4-mini). Which
  factors is vLLM's rule, fixed when the model is built: the long ones for
  every token when ``max_model_len`` exceeds the checkpoint's
  ``original_max_position_embeddings`` (read from the config being built,
  ``set_current_vllm_config`` in the model loader), the short ones otherwise.

The forward is Llama's, so are its spans (``LlamaForCausalLM.forward``,
``LlamaDecoderLayer.forward``).
"""

from __future__ import annotations

from tracevllm.model_executor.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    # Each fused parameter comes from one checkpoint tensor of the same name.
    packed_modules_mapping = {
        "qkv_proj": ["qkv_proj"],
        "gate_up_proj": ["gate_up_proj"],
    }
