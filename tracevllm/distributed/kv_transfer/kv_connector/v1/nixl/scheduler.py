"""The NixlConnector's scheduler side: which requests pull, which hold their blocks.

Mirrors vllm/distributed/kv_transfer/kv_connector/v1/nixl/scheduler.py
(``NixlConnectorScheduler``). A decode engine's request that arrives with
``do_remote_prefill`` in its ``kv_transfer_params`` asks for its whole prompt
from the connector, asynchronously (``get_num_new_matched_tokens``): the
scheduler allocates its blocks and parks it in ``WAITING_FOR_REMOTE_KVS``;
``update_state_after_alloc`` notes the blocks that are not local prefix hits
(the unhashed ones), and the next ``build_connector_meta`` tells the worker to
read the remote blocks into them. A prefill engine's request sent with
``do_remote_decode`` finishes (``max_tokens=1``) holding its blocks
(``request_finished`` returns ``delay_free_blocks=True``) and returns the
``kv_transfer_params`` the decode engine needs: this engine's id, side-channel
host and port, the block ids, and the request's trace context. Its worker
frees them when the reader says it is done, or after
``TRACEVLLM_NIXL_ABORT_REQUEST_TIMEOUT`` seconds.

Where tracevllm departs: the hold is vLLM's older fixed timeout
(``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``, 480 s) rather than 0.22's 30-second
lease renewed by the reader's heartbeats, and the returned
``kv_transfer_params`` carry three fields vLLM's do not:
``remote_expiration_time`` (when the blocks are freed unread, Unix time: the
reader refuses a read that would end after it, see nixl/worker.py),
``remote_notif_token`` (the reader's notification must carry it to free the
blocks) and ``remote_params_mac`` (this engine's HMAC over the request id,
block ids, expiry and token, with a key sent to its worker in every step's
metadata and handed to readers on the side channel: the reader checks it
before reading). The side channel is served by the producer's worker (one per
engine here) rather than by the scheduler. A client's ``kv_transfer_params``
are checked before use (``remote_prefill_params_problem``), and with
``kv_connector_extra_config["allowed_producers"]`` only the listed producer
addresses are read from (a kv_consumer without the list warns at start-up);
vLLM checks only that they are a dict. An engine whose role is
``kv_producer`` ignores ``do_remote_prefill`` (vLLM's reads for any role),
and only a producer (``kv_producer``, ``kv_both``) holds blocks for
``do_remote_decode``, and only for a request that generated at most one
token (a longer completion's blocks are freed at once, with no params: no
reader would accept them; vLLM holds for any role and length). A producer
holds at most ``kv_connector_extra_config["max_held_fraction"]`` (0.5) of
its pool for readers: past it, a finished request's blocks are freed at once
and it returns no params, so clients that never read cannot pin the whole
pool for the timeout (vLLM has no cap). Left out:
host buffers (the KV cache is in host memory already), bidirectional
transfers, Mamba and sliding-window clipping, connector stats.
"""

from __future__ import annotations

import math
import secrets
import time
from collections import Counter
from typing import TYPE_CHECKING, Any, TypeGuard

from tracevllm import envs
from tracevllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
    NixlConnectorMetadata,
    ReqId,
    SendMeta,
    compute_params_mac,
)
from tracevllm.logger import init_logger
from tracevllm.tracing import kv_transfer as kv_transfer_tracing

if TYPE_CHECKING:
    from tracevllm.config import VllmConfig
    from tracevllm.core.kv_cache_manager import KVCacheBlocks
    from tracevllm.core.sched.output import SchedulerOutput
    from tracevllm.kv_cache_interface import KVCacheConfig
    from tracevllm.outputs import KVConnectorOutput
    from tracevllm.request import Request

logger = init_logger(__name__)

# BlockPool's null block (the first block it takes from its free queue):
# a sliding-window group's table holds it, maybe many times, for blocks
# outside the window. It is never freed, so a hold does not count it.
NULL_BLOCK_ID = 0

_REMOTE_KEYS = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")


def _is_int(value: Any) -> TypeGuard[int]:
    """An int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def remote_prefill_params_problem(
    params: dict[str, Any],
    num_prompt_tokens: int,
    allowed_producers: frozenset[tuple[str, int]] | None = None,
) -> str | None:
    """What is wrong with a remote prefill's kv_transfer_params, or None.

    They arrive in the client's request (the proxy passes the prefill
    server's answer on), so everything is checked before the scheduler or
    the worker uses it: the types, a port in range, block ids that are
    non-negative ints, the producer's token count equal to this prompt's
    (a longer remote prompt's blocks would fill this one's with other KV),
    the producer's expiry and notification token (tracevllm's), and, with
    ``kv_connector_extra_config["allowed_producers"]``, a producer address
    on that list. Whether the block ids exist on the producer is checked by
    the worker, once the handshake has told it how many blocks the producer
    has, and whether the block ids, expiry and token are the producer's, by
    its MAC (``remote_params_mac``), once the handshake has given it the
    key. Another request's params sent unchanged with this prompt cannot be
    told apart (vLLM trusts the client's params throughout)."""
    if params.get("do_remote_prefill") is not True:
        return "do_remote_prefill must be true or false"
    block_ids = params.get("remote_block_ids")
    if not isinstance(block_ids, list) or not block_ids:
        return "remote_block_ids must be a non-empty list of block ids"
    if not all(_is_int(b) and b >= 0 for b in block_ids):
        return "remote_block_ids must hold non-negative integers"
    for key in ("remote_engine_id", "remote_request_id", "remote_host"):
        if not isinstance(params.get(key), str) or not params[key]:
            return f"{key} must be a non-empty string"
    port = params.get("remote_port")
    if not (_is_int(port) and 1 <= port <= 65535):
        return "remote_port must be an integer from 1 to 65535"
    num_tokens = params.get("remote_num_tokens", num_prompt_tokens)
    if not _is_int(num_tokens) or num_tokens != num_prompt_tokens:
        return f"remote_num_tokens must equal the prompt's {num_prompt_tokens} tokens"
    expiration_time = params.get("remote_expiration_time")
    if not (
        isinstance(expiration_time, (int, float))
        and not isinstance(expiration_time, bool)
        and math.isfinite(expiration_time)
    ):
        return "remote_expiration_time must be a number (the producer's Unix time)"
    token = params.get("remote_notif_token")
    if not isinstance(token, str) or not (token.isascii() and token.isalnum()):
        return "remote_notif_token must be a non-empty ASCII alphanumeric string"
    mac = params.get("remote_params_mac")
    if not (isinstance(mac, str) and len(mac) == 64 and all(c in "0123456789abcdef" for c in mac)):
        return "remote_params_mac must be 64 hex digits (the producer's HMAC-SHA256)"
    if allowed_producers is not None and (params["remote_host"], port) not in allowed_producers:
        return f"{params['remote_host']}:{port} is not in allowed_producers"
    return None


# tracevllm's kv_connector_extra_config keys in seconds, and their defaults
# (used by the worker; checked by both sides, so a bad one fails at start-up).
SECONDS_DEFAULTS = {"kv_expiry_margin": 10.0, "kv_read_timeout": 60.0}


def get_seconds(extra_config: dict[str, Any], key: str) -> float:
    value = extra_config.get(key, SECONDS_DEFAULTS[key])
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeError(f"kv_connector_extra_config[{key!r}] must be seconds, got {value!r}.")
    if value < 0:
        raise ValueError(f"kv_connector_extra_config[{key!r}] must not be negative, got {value}.")
    return float(value)


def get_max_held_fraction(extra_config: dict[str, Any]) -> float:
    """``kv_connector_extra_config["max_held_fraction"]`` (tracevllm's; vLLM
    has no cap): the share of a producer's KV cache that finished requests may
    hold for remote readers, 0.5 by default."""
    value = extra_config.get("max_held_fraction", 0.5)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise TypeError(
            "kv_connector_extra_config['max_held_fraction'] must be a number from 0 to 1, "
            f"got {value!r}."
        )
    return float(value)


def get_allowed_producers(extra_config: dict[str, Any]) -> frozenset[tuple[str, int]] | None:
    """``kv_connector_extra_config["allowed_producers"]`` (tracevllm's): the
    side-channel addresses (``"host:port"``) a decode engine may read from;
    None (the default) allows any, as vLLM does."""
    value = extra_config.get("allowed_producers")
    if value is None:
        return None
    message = (
        "kv_connector_extra_config['allowed_producers'] must be a list of "
        f"'host:port' strings, got {value!r}."
    )
    if not isinstance(value, list):
        raise TypeError(message)
    allowed = set()
    for item in value:
        host, sep, port = item.rpartition(":") if isinstance(item, str) else ("", "", "")
        if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise TypeError(message)
        allowed.add((host, int(port)))
    return frozenset(allowed)


class NixlConnectorScheduler:
    """Implementation of Scheduler side methods"""

    def __init__(
        self, vllm_config: VllmConfig, engine_id: str, kv_cache_config: KVCacheConfig
    ) -> None:
        self.vllm_config = vllm_config
        self.block_size = vllm_config.cache_config.block_size
        self.engine_id = engine_id
        self.kv_cache_config = kv_cache_config
        self.side_channel_host = envs.TRACEVLLM_NIXL_SIDE_CHANNEL_HOST
        self.side_channel_port = envs.TRACEVLLM_NIXL_SIDE_CHANNEL_PORT
        self.abort_request_timeout = envs.TRACEVLLM_NIXL_ABORT_REQUEST_TIMEOUT
        kv_transfer_config = vllm_config.kv_transfer_config
        assert kv_transfer_config is not None
        extra_config = kv_transfer_config.kv_connector_extra_config
        self.allowed_producers = get_allowed_producers(extra_config)
        # A kv_producer never reads (tracevllm's: vLLM reads for any role),
        # so it cannot be made to connect wherever a client's params say.
        self.is_consumer = kv_transfer_config.is_kv_consumer
        self.is_producer = kv_transfer_config.is_kv_producer
        if self.is_consumer and self.allowed_producers is None:
            logger.warning(
                "NixlConnector: no kv_connector_extra_config['allowed_producers']: this "
                "engine reads KV from any host and port a client's kv_transfer_params name "
                "(as vLLM does); list the prefill engines' side channels to limit it"
            )
        for key in SECONDS_DEFAULTS:
            get_seconds(extra_config, key)
        # Producer (tracevllm's): at most this many blocks held for readers at
        # once, so that clients who never read cannot pin the whole pool for
        # the abort timeout.
        self.max_held_fraction = get_max_held_fraction(extra_config)
        self.max_held_blocks = int(self.max_held_fraction * kv_cache_config.num_blocks)
        # Each held request's distinct block ids (the null block left out),
        # and how many held requests hold each block: requests that share a
        # prefix hold its blocks once, so the cap counts distinct blocks
        # (len(self._held_block_refs)).
        self._held_blocks: dict[ReqId, frozenset[int]] = {}
        self._held_block_refs: Counter[int] = Counter()
        # Producer (tracevllm's): the key of the MAC over each request's
        # params, sent to this engine's worker with every step's metadata
        # (so it has it before any request's params go out), which hands it
        # to readers on the side channel.
        self._params_key = secrets.token_bytes(32)
        # Consumer: requests to read, with their local blocks, until the next meta.
        self._reqs_need_recv: dict[ReqId, tuple[Request, list[int]]] = {}
        # Producer: finished requests holding blocks, with their expiry.
        self._reqs_need_send: dict[ReqId, float] = {}
        self._send_meta: dict[ReqId, SendMeta] = {}

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """A remote prefill: every prompt token past the local hit, read
        asynchronously (between steps)."""
        params = request.kv_transfer_params
        if params is not None and params.get("do_remote_prefill"):
            if not self.is_consumer:
                logger.warning(
                    "NixlConnector: request %s asks for a remote prefill, but this "
                    "engine's kv_role is kv_producer: it computes its prompt itself",
                    request.request_id,
                )
                params["do_remote_prefill"] = False
                return 0, False
            problem = remote_prefill_params_problem(
                params, len(request.prompt_token_ids), self.allowed_producers
            )
            if problem is not None:
                # kv_transfer_params come from the client: a bad one must not
                # reach the worker (or make it read blocks that are not this
                # prompt's). vLLM's warning; the prompt is computed here.
                logger.warning(
                    "Got invalid KVTransferParams (%s): %s. This request will not "
                    "utilize KVTransfer",
                    problem,
                    params,
                )
                params["do_remote_prefill"] = False
                return 0, False
            count = len(request.prompt_token_ids) - num_computed_tokens
            if count > 0:
                return count, True
        return 0, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return
        if params.get("remote_block_ids"):
            if all(p in params for p in _REMOTE_KEYS):
                # The blocks allocated for the remote tokens are the unhashed
                # ones (local hits are cached). None on a full local hit: the
                # worker still tells the producer, so that it frees its blocks.
                local_block_ids = blocks.get_unhashed_block_ids() if num_external_tokens > 0 else []
                self._reqs_need_recv[request.request_id] = (request, local_block_ids)
            else:
                logger.warning(
                    "Got invalid KVTransferParams: %s. This request will not utilize KVTransfer",
                    params,
                )
        else:
            assert num_external_tokens == 0
        # Only trigger 1 KV transfer per request.
        params["do_remote_prefill"] = False

    def _recv_problem(self, request: Request, params: dict[str, Any]) -> str | None:
        """Why this engine must not read (or notify) for the request's
        params, or None: the role check and ``remote_prefill_params_problem``,
        the two ``get_num_new_matched_tokens`` makes."""
        if not self.is_consumer:
            return "this engine's kv_role is kv_producer"
        return remote_prefill_params_problem(
            params, len(request.prompt_token_ids), self.allowed_producers
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> NixlConnectorMetadata:
        meta = NixlConnectorMetadata()
        for req_id, (req, block_ids) in self._reqs_need_recv.items():
            assert req.kv_transfer_params is not None
            # Checked when queued; checked again here (the flag is cleared
            # by now), so that no client field reaches the worker unchecked.
            problem = self._recv_problem(req, {**req.kv_transfer_params, "do_remote_prefill": True})
            if problem is not None and block_ids:
                # Waiting for remote KV already (WAITING_FOR_REMOTE_KVS): a
                # failed load, or it would wait, and hold its blocks, for good.
                logger.error(
                    "NixlConnector: request %s's kv_transfer_params are invalid (%s): "
                    "not read, reported as a failed load",
                    req_id,
                    problem,
                )
                meta.reqs_to_fail[req_id] = block_ids
                continue
            if problem is not None:
                logger.warning(
                    "NixlConnector: request %s's kv_transfer_params are invalid (%s): "
                    "not read, the producer not notified",
                    req_id,
                    problem,
                )
                continue
            meta.add_new_req_to_recv(
                request_id=req_id,
                local_block_ids=block_ids,
                kv_transfer_params=req.kv_transfer_params,
                trace_headers=dict(req.trace_headers) if req.trace_headers else None,
                remote_trace_headers=kv_transfer_tracing.remote_trace_headers(
                    req.kv_transfer_params
                ),
            )
        meta.reqs_to_send = self._reqs_need_send
        meta.send_meta = self._send_meta
        if self.is_producer:
            meta.params_key = self._params_key
        self._reqs_need_recv = {}
        self._reqs_need_send = {}
        self._send_meta = {}
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """The producer's held blocks that were read (or expired) are freed."""
        for req_id in connector_output.finished_sending or ():
            for block_id in self._held_blocks.pop(req_id, ()):
                # Never below zero: each held request counts each block once.
                if self._held_block_refs[block_id] > 1:
                    self._held_block_refs[block_id] -= 1
                else:
                    del self._held_block_refs[block_id]

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Once a request is finished, determine whether request blocks
        should be freed now or will be sent asynchronously and freed later.

        tracevllm's cap: a request whose blocks would bring those held for
        readers (distinct blocks: a prefix that held requests share counts
        once) past ``max_held_fraction`` of the pool frees them now and
        returns no params (its reader computes the prompt itself); vLLM holds
        every one."""
        from tracevllm.request import RequestStatus

        params = request.kv_transfer_params
        if not params:
            return False, None
        if params.get("do_remote_prefill"):
            # Aborted before it was scheduled (get_num_new_matched_tokens
            # never saw its params): the worker still notifies the producer
            # (no blocks to read), so its blocks are not stranded, but only
            # on a consumer and for params that pass the same checks, or a
            # client could make any engine connect anywhere (or, with
            # do_remote_prefill alone, fail build_connector_meta).
            problem = self._recv_problem(request, params)
            params["do_remote_prefill"] = False
            if problem is None:
                self._reqs_need_recv[request.request_id] = (request, [])
            else:
                logger.warning(
                    "NixlConnector: aborted request %s's kv_transfer_params are invalid "
                    "(%s): the producer is not notified",
                    request.request_id,
                    problem,
                )
            return False, None
        if not params.get("do_remote_decode"):
            return False, None
        if request.status not in (
            RequestStatus.FINISHED_LENGTH_CAPPED,
            RequestStatus.FINISHED_STOPPED,
        ):
            # Aborted or failed: nothing will read its blocks.
            return False, None
        # tracevllm's (vLLM holds for any role and any length): only a
        # producer serves the side channel that readers need, and only a
        # prefill (one token generated) has blocks a reader can use: a
        # reader refuses params whose remote_num_tokens is not its prompt's.
        if not self.is_producer:
            logger.warning(
                "NixlConnector: request %s asks for a remote decode, but this engine's "
                "kv_role is kv_consumer: its blocks are freed now, no kv_transfer_params "
                "returned",
                request.request_id,
            )
            return False, None
        if request.num_output_tokens > 1:
            logger.warning(
                "NixlConnector: request %s asks for a remote decode but generated %d "
                "tokens (a prefill for a decode server generates one): its blocks are "
                "freed now, no kv_transfer_params returned",
                request.request_id,
                request.num_output_tokens,
            )
            return False, None

        # Distinct blocks: a prefix shared with requests already held adds
        # none, and the null block (a sliding window's) is no block of the pool's.
        held = frozenset(block_ids) - {NULL_BLOCK_ID}
        num_held = len(self._held_block_refs)
        num_new = len(held - self._held_block_refs.keys())
        if block_ids and num_held + num_new > self.max_held_blocks:
            logger.warning(
                "NixlConnector: request %s's %d blocks would bring the blocks held for "
                "remote readers to %d of %d (max_held_fraction %.2f): freed now, "
                "no kv_transfer_params returned",
                request.request_id,
                len(block_ids),
                num_held + num_new,
                self.kv_cache_config.num_blocks,
                self.max_held_fraction,
            )
            return False, None

        delay_free_blocks = len(block_ids) > 0
        # The hold's end, told to the reader too (tracevllm's): a read that
        # would end after it could copy blocks this engine has since reused,
        # so the reader refuses it (a failed load) rather than trust it.
        expiration_time = time.time() + self.abort_request_timeout
        # Only a reader given these params can free the blocks early.
        notif_token = secrets.token_hex(16)
        if delay_free_blocks:
            self._held_blocks[request.request_id] = held
            self._held_block_refs.update(held)
            self._reqs_need_send[request.request_id] = (
                time.perf_counter() + self.abort_request_timeout
            )
            self._send_meta[request.request_id] = SendMeta(
                num_blocks=len(block_ids),
                num_tokens=request.num_computed_tokens,
                trace_headers=dict(request.trace_headers) if request.trace_headers else None,
                start_ns=time.time_ns(),
                notif_token=notif_token,
            )
        kv_transfer_params: dict[str, Any] = dict(
            do_remote_prefill=True,
            do_remote_decode=False,
            remote_block_ids=block_ids,
            remote_engine_id=self.engine_id,
            remote_request_id=request.request_id,
            remote_host=self.side_channel_host,
            remote_port=self.side_channel_port,
            tp_size=self.vllm_config.parallel_config.tensor_parallel_size,
            remote_num_tokens=request.num_computed_tokens,
            remote_expiration_time=expiration_time,
            remote_notif_token=notif_token,
            remote_params_mac=compute_params_mac(
                self._params_key, request.request_id, block_ids, expiration_time, notif_token
            ),
        )
        return delay_free_blocks, kv_transfer_tracing.add_trace_context(
            kv_transfer_params, request.trace_headers
        )
