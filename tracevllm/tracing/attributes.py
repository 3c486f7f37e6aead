"""Span attribute names, in one place.

Three groups, so that nobody mistakes one for another: vLLM's own names
(vllm/tracing/utils.py ``SpanAttributes``, set as vLLM sets them on its
``llm_request`` span); names from the OpenTelemetry GenAI semantic conventions
that vLLM does not set (``gen_ai.usage.input_tokens``, ``gen_ai.request.top_k``
...), which tracevllm adds; and tracevllm's own (``tracevllm.*``), for the
views. The GenAI conventions are still "development", so names are constants.
"""

from __future__ import annotations


class SpanAttributes:
    # --- vLLM's (vllm/tracing/utils.py) --------------------------------------
    GEN_AI_REQUEST_ID = "gen_ai.request.id"
    GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
    GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
    GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
    GEN_AI_REQUEST_N = "gen_ai.request.n"
    GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
    GEN_AI_USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    GEN_AI_USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    GEN_AI_LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
    GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
    GEN_AI_LATENCY_E2E = "gen_ai.latency.e2e"
    GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
    GEN_AI_LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
    GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE = "gen_ai.latency.time_in_model_inference"

    # --- OTel GenAI semantic conventions that vLLM does not set ---------------
    GEN_AI_REQUEST_TOP_K = "gen_ai.request.top_k"
    GEN_AI_REQUEST_SEED = "gen_ai.request.seed"
    GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
    GEN_AI_USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
    GEN_AI_USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"

    # Where the span was emitted (OTel code semantic conventions; vLLM uses
    # the older code.function / code.filepath / code.lineno).
    CODE_FUNCTION_NAME = "code.function.name"
    CODE_FILE_PATH = "code.file.path"
    CODE_LINE_NUMBER = "code.line.number"

    # --- tracevllm's own --------------------------------------------------------
    PROCESS_KIND = "tracevllm.process_kind"
    # A worker process's place (its TracerProvider's resource): global rank,
    # tensor, pipeline and data parallel rank.
    RANK = "tracevllm.rank"
    TP_RANK = "tracevllm.tp_rank"
    PP_RANK = "tracevllm.pp_rank"
    DP_RANK = "tracevllm.dp_rank"
    # A collective between ranks (detail "full"): its group ("tp", "pp", "dp",
    # "world") and size, the bytes of its result (nccl-tests' "size": the
    # gathered tensor for an all-gather), and the milliseconds it took.
    COMM_GROUP = "tracevllm.comm.group"
    COMM_WORLD_SIZE = "tracevllm.comm.world_size"
    COMM_BYTES = "tracevllm.comm.bytes"
    COMM_MS = "tracevllm.comm.ms"
    STEP_ID = "tracevllm.step_id"
    REQUEST_IDS = "tracevllm.request_ids"
    NUM_CACHED_TOKENS = "tracevllm.num_cached_tokens"
    # The engine's KV connector's class name (on each Scheduler.schedule span).
    KV_CONNECTOR = "tracevllm.kv_connector.name"
    COMPLETION_TEXT = "tracevllm.completion.text"
    INTER_TOKEN_MS = "tracevllm.latency.inter_token_ms"
    # A span whose record function raised: the error, in place of what it records.
    RECORD_ERROR = "tracevllm.record_error"
    # Speculative decoding, per request: steps with drafts, drafts, accepted.
    SPEC_DECODE_NUM_DRAFTS = "tracevllm.spec_decode.num_drafts"
    SPEC_DECODE_NUM_DRAFT_TOKENS = "tracevllm.spec_decode.num_draft_tokens"
    SPEC_DECODE_NUM_ACCEPTED_TOKENS = "tracevllm.spec_decode.num_accepted_tokens"
    SPEC_DECODE_ACCEPTANCE_RATE = "tracevllm.spec_decode.acceptance_rate"
    # JSON documents the views are drawn from (OTel attributes are flat).
    STEP_VIEW = "tracevllm.view.step"
    # req_id -> tokens its grammar's mask allowed, this step.
    GRAMMAR_VIEW = "tracevllm.view.grammar"
    # req_id -> its drafts, how many were kept, the next token, the running rate.
    SPEC_VIEW = "tracevllm.view.spec"
    COMPLETION_VIEW = "tracevllm.view.completion"
