"""Logits processors (vllm/v1/sample/logits_processor/): the built-in ones
only (min-tokens, logit bias, min-p); custom processors are left out."""

from tracevllm.sample.logits_processor.builtin import (
    LogitBiasLogitsProcessor,
    MinPLogitsProcessor,
    MinTokensLogitsProcessor,
)
from tracevllm.sample.logits_processor.interface import LogitsProcessor
from tracevllm.sample.logits_processor.state import LogitsProcessors

__all__ = [
    "LogitBiasLogitsProcessor",
    "LogitsProcessor",
    "LogitsProcessors",
    "MinPLogitsProcessor",
    "MinTokensLogitsProcessor",
]
