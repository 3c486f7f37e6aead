"""The NixlConnector's worker side: NIXL READs of a remote engine's KV blocks.

Mirrors vllm/distributed/kv_transfer/kv_connector/v1/nixl/worker.py
(``NixlConnectorWorker``). Each worker owns a NIXL agent (UCX backend) and
registers its KV cache tensors with it (``register_kv_caches``): one region
per layer, described block by block, so that a transfer names blocks by
index. A prefill engine's worker answers the side channel (ZeroMQ, msgpack)
with its agent's metadata and where its blocks lie. A decode engine's worker,
told to read a request's blocks (``start_load_kv``), first fetches that
metadata once per remote engine in a background thread (``_nixl_handshake``),
adds the remote agent, then posts one non-blocking READ of every layer's
blocks with a notification for the producer (``_read_blocks``);
``get_finished`` polls the transfers (``finished_recving``) and the
producer's notifications (``finished_sending``: its blocks can go), and frees
a producer's blocks that no one read after ``TRACEVLLM_NIXL_ABORT_REQUEST_TIMEOUT``
seconds. A handshake or transfer that fails marks the request's blocks
invalid: the scheduler recomputes them or fails the request
(``kv_load_failure_policy``). Each transfer is one span (bytes, blocks,
layers, milliseconds): the load on the decode side, the send (from the
request's end to the reader's notification) on the prefill side.

Where tracevllm departs from vLLM, and why:

- Expiry instead of leases. The producer frees unread blocks at a fixed time
  (vLLM 0.22 renews a lease with heartbeats), and says when in
  ``kv_transfer_params["remote_expiration_time"]`` (Unix time). A READ that
  would start, or is only seen to end, less than ``kv_expiry_margin``
  seconds (``kv_connector_extra_config``, 10 s) before it is a failed load:
  the producer may have reused the blocks, and the bytes read would be
  another request's KV, cached under this prompt's hashes. The margin must
  cover the two hosts' clock difference.
- The expiry travels in the client's request, as the block ids do, so the
  producer signs them: ``remote_params_mac`` is its HMAC-SHA256 over the
  request id, block ids, expiry and token, with a key its scheduler makes
  and its side channel hands to readers (in ``NixlAgentMetadata``). The
  reader checks it before posting the READ; a change (old params replayed
  with a fresh expiry, other block ids) is a failed load, so blocks the
  producer may have reused are not cached under the prompt's hashes. The
  reader cannot tell a forged MAC from a key of its own that is stale (the
  producer restarted, or answered the handshake before its first step gave
  it a key): on a mismatch it keeps the key for every other request, fetches
  it again in the background (at most once per producer every
  ``PARAMS_KEY_REFRESH_INTERVAL_S``; within that the key is fresh and the
  request fails at once) and checks that one request once more against the
  key fetched: it fails if it mismatches that too. So a forged MAC fails
  only its own request (the agent, and its READs in flight, stay). What
  it cannot catch: another request's params sent unchanged, before they
  expire, with a different prompt. vLLM trusts the client's params.
- A READ still in progress after ``kv_read_timeout`` seconds (60 s) is
  released (NIXL cancels it) and fails, so that a hung peer cannot keep a
  request, and its blocks, for good (vLLM waits).
- Remote agents are keyed by (engine id, side-channel host, port), not by
  engine id alone: the address comes from the client, and a side channel
  answering with a real producer's id must not stand in for it at another
  address. ``kv_connector_extra_config["allowed_producers"]`` (a list of
  ``"host:port"``) limits the addresses at all (checked by the scheduler).
- Notifications are ``<request id>:<token>:<tp size>``; the token comes with
  ``kv_transfer_params`` (``remote_notif_token``), so only a reader given a
  request's params can free its blocks early. A malformed notification is
  dropped, not raised in the engine's step. One for a request the worker has
  not heard of yet (a fast reader) is kept for the request, if its token has
  the producer's form (32 hex digits), and at most ``MAX_EARLY_NOTIFS`` of
  them (10 000, the oldest dropped), each kept as a 32-byte digest of its
  request id (the id is the client's ``X-Request-Id``, of any length), so
  they are bounded in bytes too.
- Only a producer (``kv_producer``, ``kv_both``) serves the side channel,
  which hands its agent metadata and memory layout to anyone who connects
  (so keep ``TRACEVLLM_NIXL_SIDE_CHANNEL_HOST`` on a private address; it
  defaults to localhost); vLLM's consumers serve it too.

Left out: heterogeneous tensor parallelism, block sizes and layouts, host
buffers, heartbeats, cross-layer blocks, transfer telemetry and stats.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import queue
import threading
import time
import uuid
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import msgspec
import zmq

from tracevllm import envs
from tracevllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
    GET_META_MSG,
    EngineId,
    NixlAgentMetadata,
    NixlConnectorMetadata,
    NixlHandshakePayload,
    RemoteAgentKey,
    RemoteMeta,
    ReqId,
    ReqMeta,
    SendMeta,
    compute_nixl_compatibility_hash,
    compute_params_mac,
)
from tracevllm.distributed.kv_transfer.kv_connector.v1.nixl.scheduler import get_seconds
from tracevllm.logger import init_logger
from tracevllm.tracing import kv_transfer as kv_transfer_tracing

if TYPE_CHECKING:
    import torch

    from tracevllm.config import VllmConfig

logger = init_logger(__name__)

CONNECTOR_NAME = "NixlConnector"
# A dead or absent side channel fails the handshake after this long.
HANDSHAKE_TIMEOUT_MS = 5000
# Notifications kept for requests this worker has not heard of yet (the
# oldest dropped past it): anyone who reaches the agent can send them.
MAX_EARLY_NOTIFS = 10_000
# A MAC mismatch fetches the producer's params key again at most this often
# (a fresher key is not stale: the request fails at once).
PARAMS_KEY_REFRESH_INTERVAL_S = 5.0
# A notification token as the producer's scheduler makes it (secrets.token_hex(16)).
_NOTIF_TOKEN_LEN = 32
_HEX_DIGITS = frozenset("0123456789abcdef")


class _PeerWarnings:
    """Warnings about what a peer sent (malformed side-channel messages and
    notifications), at most one per kind every ``interval`` seconds with the
    count of those left out: anyone who reaches the side channel or the
    agent can send them, as fast as they like. The side channel's thread and
    the step's thread use it for different kinds, so no two threads update
    one kind's entries (no lock)."""

    def __init__(self, interval: float = 10.0) -> None:
        self.interval = interval
        self._last: dict[str, float] = {}
        self._left_out: dict[str, int] = defaultdict(int)

    def warn(self, kind: str, msg: str, *args: Any) -> None:
        now = time.monotonic()
        last = self._last.get(kind)
        if last is not None and now - last < self.interval:
            self._left_out[kind] += 1
            return
        self._last[kind] = now
        left_out = self._left_out.pop(kind, 0)
        if left_out:
            msg += f" (and {left_out} more like it since the last such warning)"
        logger.warning(msg, *args)


def is_notif_token(token: str) -> bool:
    return len(token) == _NOTIF_TOKEN_LEN and set(token) <= _HEX_DIGITS


def id_digest(req_id: str) -> bytes:
    """A request id's fixed-size stand-in in the early notifications."""
    return hashlib.blake2b(req_id.encode(), digest_size=32).digest()


def make_zmq_path(scheme: str, host: str, port: int) -> str:
    return f"{scheme}://{host}:{port}"


def _wall_time() -> float:
    """Unix time, which the producer's ``remote_expiration_time`` is in."""
    return time.time()


def make_notif(request_id: str, notif_token: str) -> bytes:
    """The reader's "done" for the producer: ``<its request id>:<token>:<tp size>``
    (vLLM's is ``<request id>:<tp size>``; the token is tracevllm's)."""
    return f"{request_id}:{notif_token}:1".encode()


def parse_notif(notif: bytes) -> tuple[ReqId, str] | None:
    """(request id, token) of a notification, or None for anything else: a
    notification comes from whoever can reach this agent, so a malformed
    one is dropped, never raised inside the engine's step."""
    if not isinstance(notif, bytes):
        return None
    try:
        msg = notif.decode("utf-8")
    except (UnicodeDecodeError, AttributeError):
        return None
    parts = msg.rsplit(":", 2)
    if len(parts) != 3 or not parts[0] or not parts[1]:
        return None
    return parts[0], parts[1]


class NixlConnectorWorker:
    """Implementation of Worker side methods"""

    def __init__(self, vllm_config: VllmConfig, engine_id: str) -> None:
        try:
            from nixl._api import nixl_agent, nixl_agent_config
        except ImportError as e:
            raise RuntimeError(
                "NIXL is not available: pip install nixl (tracevllm pins it in its dev extra)."
            ) from e
        self.vllm_config = vllm_config
        self.engine_id: EngineId = engine_id
        self.block_size = vllm_config.cache_config.block_size
        self.side_channel_host = envs.TRACEVLLM_NIXL_SIDE_CHANNEL_HOST
        self.side_channel_port = envs.TRACEVLLM_NIXL_SIDE_CHANNEL_PORT
        self.compat_hash = compute_nixl_compatibility_hash(vllm_config)
        kv_transfer_config = vllm_config.kv_transfer_config
        assert kv_transfer_config is not None
        self.is_producer = kv_transfer_config.is_kv_producer
        extra_config = kv_transfer_config.kv_connector_extra_config
        # tracevllm's: a read must end this long before the producer's
        # expiry (covers the two hosts' clock difference) ...
        self.kv_expiry_margin = get_seconds(extra_config, "kv_expiry_margin")
        # ... and a READ still in progress after this long is abandoned.
        self.kv_read_timeout = get_seconds(extra_config, "kv_read_timeout")
        self.nixl_wrapper = nixl_agent(str(uuid.uuid4()), nixl_agent_config(backends=["UCX"]))

        # Set in register_kv_caches.
        self.num_blocks = 0
        self.num_layers = 0
        self.block_lens: list[int] = []
        self.kv_caches_base_addr: list[int] = []
        self._registered_descs: Any = None
        self.src_xfer_side_handle: Any = None
        self._handshake_payload = b""
        # Producer: the key of its params' MACs (from its scheduler, with the
        # step's metadata). Consumer: each remote engine's, from the handshake.
        self._params_key = b""
        self._remote_params_keys: dict[RemoteAgentKey, bytes] = {}
        # When each remote engine's key was last fetched (time.monotonic), and
        # the requests parked on a fetch after their MAC mismatched (checked
        # once more, against the key fetched).
        self._params_key_fetched: dict[RemoteAgentKey, float] = {}
        self._mac_rechecked: set[ReqId] = set()
        # Each remote engine's agent metadata as its handshake gave it: a
        # handshake again (for a params key not known, or no longer right)
        # that gets the same agent only updates the key.
        self._remote_agent_metadata: dict[RemoteAgentKey, bytes] = {}
        # A restarted remote engine's old agent and descriptors: its READs in
        # flight may still hold them, so they go at shutdown.
        self._retired_remote: list[tuple[str, Any]] = []

        # Remote engines: agent name, prepared block descriptors, block count;
        # keyed by engine id and side-channel address (vLLM: engine id alone),
        # so that a side channel answering with another engine's id is only
        # ever used for requests that name its own address.
        self._remote_agents: dict[RemoteAgentKey, str] = {}
        self.dst_xfer_side_handles: dict[RemoteAgentKey, Any] = {}
        self.dst_num_blocks: dict[RemoteAgentKey, int] = {}
        self._handshake_futures: dict[RemoteAgentKey, Future[str]] = {}
        self._handshake_lock = threading.RLock()
        self._handshake_initiation_executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="tracevllm-nixl-handshake"
        )
        # Filled from the handshake thread, drained by the step.
        self._ready_requests: queue.Queue[tuple[ReqId, ReqMeta]] = queue.Queue()
        self._failed_recv_reqs: queue.Queue[ReqId] = queue.Queue()
        self._invalid_block_ids: queue.Queue[set[int]] = queue.Queue()

        # Consumer: each request's metadata and its READs in flight.
        self._recving_metadata: dict[ReqId, ReqMeta] = {}
        self._recving_transfers: dict[ReqId, list[Any]] = defaultdict(list)
        self._recv_start_ns: dict[ReqId, int] = {}
        # When each request's READ was posted (time.monotonic), for kv_read_timeout.
        self._recv_posted: dict[ReqId, float] = {}
        # Producer: requests whose blocks wait for a reader, with their
        # expiry (time.perf_counter), oldest first; notifications that came
        # before the request did (tracevllm's), by (digest of the request
        # id, token), with their arrival time.
        self._reqs_to_send: dict[ReqId, float] = {}
        self._send_meta: dict[ReqId, SendMeta] = {}
        self._early_notifs: dict[tuple[bytes, str], float] = {}
        self._peer_warnings = _PeerWarnings()
        # Requests read before this worker heard of them: reported by the
        # next get_finished, so that the scheduler frees their blocks.
        self._done_sending_early: set[ReqId] = set()

        self._stop_listener = threading.Event()
        self._nixl_handshake_listener_t: threading.Thread | None = None

    # ------------------------------------------------------------ registration
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Register each layer's KV tensor with NIXL, describe it block by
        block, and, on a producer, start answering the side channel (a
        consumer's blocks are read by no one, so it serves no one: vLLM's
        engines all serve it)."""
        caches = [kv_caches[name] for name in sorted(kv_caches)]
        self.num_layers = len(caches)
        self.num_blocks = caches[0].shape[0]
        regions = []
        for cache in caches:  # [num_blocks, 2, block_size, H_kv, D]
            assert cache.is_contiguous() and cache.shape[0] == self.num_blocks
            region_len = cache.numel() * cache.element_size()
            self.kv_caches_base_addr.append(cache.data_ptr())
            self.block_lens.append(region_len // self.num_blocks)
            regions.append((cache.data_ptr(), region_len, 0, ""))
        self._registered_descs = self.nixl_wrapper.get_reg_descs(regions, "DRAM")
        self.nixl_wrapper.register_memory(self._registered_descs)
        self.src_xfer_side_handle = self.nixl_wrapper.prep_xfer_dlist(
            "NIXL_INIT_AGENT", self._block_descs(self.kv_caches_base_addr, self.num_blocks), "DRAM"
        )
        self._encode_handshake_payload()
        if not self.is_producer:
            return
        ready = threading.Event()
        self._nixl_handshake_listener_t = threading.Thread(
            target=self._nixl_handshake_listener,
            args=(ready,),
            daemon=True,
            name="tracevllm-nixl-handshake-listener",
        )
        self._nixl_handshake_listener_t.start()
        ready.wait()

    def _encode_handshake_payload(self) -> None:
        """What the side channel answers (again once the scheduler's params key
        has come: the listener sends whichever payload is current)."""
        agent_metadata = NixlAgentMetadata(
            engine_id=self.engine_id,
            agent_metadata=self.nixl_wrapper.get_agent_metadata(),
            kv_caches_base_addr=self.kv_caches_base_addr,
            num_blocks=self.num_blocks,
            block_lens=self.block_lens,
            block_size=self.block_size,
            params_key=self._params_key,
        )
        self._handshake_payload = msgspec.msgpack.encode(
            NixlHandshakePayload(
                compatibility_hash=self.compat_hash,
                agent_metadata_bytes=msgspec.msgpack.encode(agent_metadata),
            )
        )

    def _block_descs(self, base_addrs: list[int], num_blocks: int) -> list[tuple[int, int, int]]:
        """(address, length, device) of every block, layer-major: block b of
        layer l is descriptor l * num_blocks + b."""
        return [
            (base + block_id * block_len, block_len, 0)
            for base, block_len in zip(base_addrs, self.block_lens, strict=True)
            for block_id in range(num_blocks)
        ]

    def _nixl_handshake_listener(self, ready: threading.Event) -> None:
        """Answer GET_META_MSG with this worker's handshake payload."""
        path = make_zmq_path("tcp", self.side_channel_host, self.side_channel_port)
        ctx = zmq.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.bind(path)
        except zmq.ZMQError:
            logger.exception("NixlConnector: cannot bind the side channel at %s", path)
            sock.close()
            ctx.term()
            ready.set()
            return
        logger.debug("NixlConnector: side channel listening at %s", path)
        ready.set()
        try:
            while not self._stop_listener.is_set():
                if not sock.poll(100):
                    continue
                frames = sock.recv_multipart()
                if len(frames) != 3:
                    # Not a ROUTER-framed request (a stray peer): drop it and
                    # keep serving, or every later handshake would fail.
                    self._peer_warnings.warn(
                        "frames", "NixlConnector: side-channel message of %d frames", len(frames)
                    )
                    continue
                identity, _, msg = frames
                try:
                    request = msgspec.msgpack.decode(msg)
                except msgspec.DecodeError:
                    request = None
                if not isinstance(request, list) or request[:1] != [GET_META_MSG]:
                    self._peer_warnings.warn(
                        "message", "NixlConnector: unexpected side-channel message %r", msg[:64]
                    )
                    sock.send_multipart((identity, b"", b""))
                    continue
                sock.send_multipart((identity, b"", self._handshake_payload))
        finally:
            sock.close()
            ctx.term()

    # --------------------------------------------------------------- handshake
    # --8<-- [start:nixl_handshake]
    def _nixl_handshake(self, host: str, port: int, expected_engine_id: str) -> str:
        """Fetch a remote worker's agent metadata over its side channel, add
        its agent, and prepare its blocks' descriptors. Returns its agent name."""
        path = make_zmq_path("tcp", host, port)
        with _zmq_req_socket(path) as sock:
            sock.send(msgspec.msgpack.encode((GET_META_MSG, 0)))
            handshake_bytes = sock.recv()  # zmq.Again after HANDSHAKE_TIMEOUT_MS
        try:
            payload = msgspec.msgpack.decode(handshake_bytes, type=NixlHandshakePayload)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise RuntimeError(
                "Failed to decode NixlHandshakePayload. This likely indicates "
                f"an incompatibility between connector version. Error: {e}"
            ) from e
        if payload.compatibility_hash != self.compat_hash:
            raise RuntimeError(
                f"NIXL compatibility hash mismatch. Local: {self.compat_hash}, "
                f"Remote: {payload.compatibility_hash}. Prefill and decode instances "
                "have incompatible configurations (model, dtype, KV heads, layers)."
            )
        meta = msgspec.msgpack.decode(payload.agent_metadata_bytes, type=NixlAgentMetadata)
        if meta.engine_id != expected_engine_id:
            raise RuntimeError(
                f"Remote NIXL agent engine ID mismatch. Expected {expected_engine_id}, "
                f"received {meta.engine_id}."
            )
        if meta.block_size != self.block_size or meta.block_lens != self.block_lens:
            raise RuntimeError(
                f"Remote engine {meta.engine_id} has block size {meta.block_size} and "
                f"block lengths {meta.block_lens[:1]}..., this one {self.block_size} and "
                f"{self.block_lens[:1]}...: tracevllm reads only identical layouts."
            )
        key = (meta.engine_id, host, port)
        if (
            key in self._remote_agents
            and self._remote_agent_metadata.get(key) == meta.agent_metadata
        ):
            # The agent this worker has (a handshake again for the params
            # key): its READs in flight go on.
            self._set_remote_params_key(key, meta.params_key)
            return self._remote_agents[key]
        agent_name = self.nixl_wrapper.add_remote_agent(meta.agent_metadata)
        handle = self.nixl_wrapper.prep_xfer_dlist(
            agent_name, self._block_descs(meta.kv_caches_base_addr, meta.num_blocks), "DRAM"
        )
        if key in self._remote_agents:  # restarted: another agent at that address
            self._retired_remote.append((self._remote_agents[key], self.dst_xfer_side_handles[key]))
        self.dst_xfer_side_handles[key] = handle
        self.dst_num_blocks[key] = meta.num_blocks
        self._remote_agent_metadata[key] = meta.agent_metadata
        self._set_remote_params_key(key, meta.params_key)
        self._remote_agents[key] = agent_name
        return agent_name

    # --8<-- [end:nixl_handshake]

    def _set_remote_params_key(self, key: RemoteAgentKey, params_key: bytes) -> None:
        """Keep a remote engine's params key; an empty one (the producer's
        side channel answers before its first step brings its key) is not
        kept, so that the next request to it handshakes again."""
        self._params_key_fetched[key] = time.monotonic()
        if params_key:
            self._remote_params_keys[key] = params_key
        else:
            self._remote_params_keys.pop(key, None)

    def _refresh_params_key(self, req_id: ReqId, meta: ReqMeta) -> bool:
        """A request's MAC did not match the remote engine's key (or there is
        none): the key may be stale (the producer restarted, or answered
        before it had one). The key stays for every other request; this one
        is parked on a handshake that fetches the key again (one in flight
        is shared) and checked once more when it completes. False (the
        request fails now) if it was checked again already, or the key was
        fetched less than ``PARAMS_KEY_REFRESH_INTERVAL_S`` ago: forged MACs
        cannot make this worker handshake at their rate."""
        key = meta.remote.agent_key
        with self._handshake_lock:
            if req_id in self._mac_rechecked:
                return False
            future = self._handshake_futures.get(key)
            in_flight = future is not None and not future.done()
            fetched = self._params_key_fetched.get(key)
            if (
                not in_flight
                and fetched is not None
                and time.monotonic() - fetched < PARAMS_KEY_REFRESH_INTERVAL_S
            ):
                return False
            self._mac_rechecked.add(req_id)
            if not in_flight:
                # The attempt counts, whether or not the handshake succeeds:
                # a producer that cannot be reached is not asked again sooner.
                self._params_key_fetched[key] = time.monotonic()
            self._background_nixl_handshake(req_id, meta, refresh=True)
        return True

    def _background_nixl_handshake(
        self, req_id: ReqId, meta: ReqMeta, refresh: bool = False
    ) -> None:
        """Handshake in the background (once per remote engine, and again for
        a params key the last one did not bring, or to refresh it); the
        request's read starts in the step after it completes."""
        remote = meta.remote
        future = self._handshake_futures.get(remote.agent_key)
        if future is None or (
            future.done() and (refresh or remote.agent_key not in self._remote_params_keys)
        ):
            future = self._handshake_initiation_executor.submit(
                self._nixl_handshake, remote.host, remote.port, remote.engine_id
            )
            self._handshake_futures[remote.agent_key] = future

        def request_ready(f: Future[str], entry: tuple[ReqId, ReqMeta] = (req_id, meta)) -> None:
            try:
                f.result()
            except Exception as e:
                logger.error(
                    "NixlConnector: handshake with %s:%s (engine %s) failed for request %s: %s",
                    remote.host,
                    remote.port,
                    remote.engine_id,
                    req_id,
                    e,
                )
                with self._handshake_lock:
                    if self._handshake_futures.get(remote.agent_key) is f:
                        del self._handshake_futures[remote.agent_key]  # the next one retries
                self._handle_failed_transfer(req_id, None)
                return
            self._ready_requests.put(entry)

        future.add_done_callback(request_ready)

    # ------------------------------------------------------------------ reads
    def start_load_kv(self, metadata: NixlConnectorMetadata) -> None:
        """Start this step's reads (non-blocking); note the producer's
        finished requests, which wait for their readers."""
        if metadata.params_key and metadata.params_key != self._params_key:
            self._params_key = metadata.params_key
            self._encode_handshake_payload()
        for req_id, local_block_ids in metadata.reqs_to_fail.items():
            # Params the scheduler refused after it parked the request: a
            # failed load (reported by get_finished, its blocks invalid).
            self._invalid_block_ids.put(set(local_block_ids))
            self._failed_recv_reqs.put(req_id)
        for req_id, meta in metadata.reqs_to_recv.items():
            if meta.local_block_ids:
                # Reported through get_finished; an empty list (a full local
                # hit, or a request aborted before it ran) only notifies.
                self._recving_metadata[req_id] = meta
                self._recv_start_ns[req_id] = time.time_ns()
                if self._is_expired(req_id, meta):
                    continue  # no handshake for blocks the producer is freeing
            with self._handshake_lock:
                key = meta.remote.agent_key
                if key not in self._remote_agents or key not in self._remote_params_keys:
                    self._background_nixl_handshake(req_id, meta)
                    continue
            self._read_blocks_for_req(req_id, meta)
        while not self._ready_requests.empty():
            self._read_blocks_for_req(*self._ready_requests.get_nowait())

        for req_id, expiration_time in metadata.reqs_to_send.items():
            send = metadata.send_meta[req_id]
            self._send_meta[req_id] = send
            if self._early_notifs.pop((id_digest(req_id), send.notif_token), None) is not None:
                self._finish_send(req_id, None)  # already read
                self._done_sending_early.add(req_id)
            else:
                self._reqs_to_send[req_id] = expiration_time

    def _is_expired(self, req_id: ReqId, meta: ReqMeta) -> bool:
        """Whether the producer may free (and reuse) the request's blocks
        before now plus ``kv_expiry_margin``; if so, the load fails (tracevllm's:
        vLLM's reader renews a lease instead). Reported as a failed load.
        The expiry is the one in the request's ``kv_transfer_params``; one a
        client changed fails the producer's MAC (``_params_mac_ok``)."""
        if _wall_time() < meta.remote.expiration_time - self.kv_expiry_margin:
            return False
        logger.error(
            "NixlConnector: request %s's remote blocks expire at %.1f (now %.1f, margin "
            "%.1f s): the producer may reuse them, so the load fails and its blocks "
            "are marked invalid",
            req_id,
            meta.remote.expiration_time,
            _wall_time(),
            self.kv_expiry_margin,
        )
        self._handle_failed_transfer(req_id, None)
        return True

    # --8<-- [start:read_blocks]
    def _read_blocks_for_req(self, req_id: ReqId, meta: ReqMeta) -> None:
        remote = meta.remote
        agent_name = self._remote_agents[remote.agent_key]
        # The producer frees the request's blocks on it (token checked).
        notif_id = make_notif(remote.request_id, remote.notif_token)
        local_block_ids = meta.local_block_ids
        if not local_block_ids:
            # Nothing to read (a full local hit, or aborted): free the producer's blocks.
            self.nixl_wrapper.send_notif(agent_name, notif_msg=notif_id)
            return
        if self._is_expired(req_id, meta):  # the handshake took too long
            return
        if not self._params_mac_ok(remote):
            if self._refresh_params_key(req_id, meta):
                logger.warning(
                    "NixlConnector: request %s's kv_transfer_params do not carry the "
                    "producer's MAC under this worker's key for it: fetching the key "
                    "again, then checking once more",
                    req_id,
                )
                return
            logger.error(
                "NixlConnector: request %s's kv_transfer_params do not carry the producer's "
                "MAC (changed by the client, or not that producer's): not read, its blocks "
                "marked invalid",
                req_id,
            )
            self._handle_failed_transfer(req_id, None)
            return
        self._mac_rechecked.discard(req_id)
        # A local prefix hit covers the first blocks: read only the rest.
        remote_block_ids = remote.block_ids[-len(local_block_ids) :]
        if len(remote_block_ids) != len(local_block_ids):
            logger.error(
                "NixlConnector: request %s has %d local blocks to fill, the remote %d",
                req_id,
                len(local_block_ids),
                len(remote_block_ids),
            )
            self._handle_failed_transfer(req_id, None)
            return
        remote_num_blocks = self.dst_num_blocks[remote.agent_key]
        if any(b >= remote_num_blocks for b in remote_block_ids):
            # The ids came with the request: one past the producer's pool
            # would read another layer's block.
            logger.error(
                "NixlConnector: request %s names blocks the producer does not have (%d blocks)",
                req_id,
                remote_num_blocks,
            )
            self._handle_failed_transfer(req_id, None)
            return
        local_ids = [
            layer * self.num_blocks + b for layer in range(self.num_layers) for b in local_block_ids
        ]
        remote_ids = [
            layer * remote_num_blocks + b
            for layer in range(self.num_layers)
            for b in remote_block_ids
        ]
        handle = None
        try:
            handle = self.nixl_wrapper.make_prepped_xfer(
                "READ",
                self.src_xfer_side_handle,
                local_ids,
                self.dst_xfer_side_handles[remote.agent_key],
                remote_ids,
                notif_msg=notif_id,
            )
            state = self.nixl_wrapper.transfer(handle)
            if state == "ERR":
                raise RuntimeError("NIXL transfer posted in state ERR")
        except Exception as e:
            logger.error("NixlConnector: cannot read request %s's blocks: %s", req_id, e)
            self._handle_failed_transfer(req_id, handle)
            return
        self._recving_transfers[req_id].append(handle)
        self._recv_posted[req_id] = time.monotonic()

    # --8<-- [end:read_blocks]

    def _params_mac_ok(self, remote: RemoteMeta) -> bool:
        """Whether the request's block ids, expiry and token are the ones the
        producer signed (tracevllm's; vLLM trusts the client's params)."""
        key = self._remote_params_keys.get(remote.agent_key, b"")
        expected = compute_params_mac(
            key, remote.request_id, remote.block_ids, remote.expiration_time, remote.notif_token
        )
        return bool(key) and hmac.compare_digest(expected, remote.params_mac)

    def _handle_failed_transfer(self, req_id: ReqId, handle: Any) -> None:
        """Mark the request's blocks invalid; report it done (failed)."""
        self._mac_rechecked.discard(req_id)
        if (meta := self._recving_metadata.get(req_id)) is not None:
            self._invalid_block_ids.put(set(meta.local_block_ids))
            self._failed_recv_reqs.put(req_id)
        if handle is not None:
            with contextlib.suppress(Exception):
                self.nixl_wrapper.release_xfer_handle(handle)

    def _pop_done_transfers(self) -> set[ReqId]:
        """Requests whose every READ is DONE (or failed, or abandoned)."""
        done_req_ids: set[ReqId] = set()
        now = time.monotonic()
        for req_id, handles in list(self._recving_transfers.items()):
            in_progress = []
            failed = False
            for handle in handles:
                try:
                    xfer_state = self.nixl_wrapper.check_xfer_state(handle)
                except Exception as e:
                    xfer_state = f"exception {e}"
                if xfer_state == "DONE":
                    self.nixl_wrapper.release_xfer_handle(handle)
                elif xfer_state == "PROC":
                    in_progress.append(handle)
                else:
                    logger.error(
                        "NixlConnector: transfer for request %s failed (%s): "
                        "marking its blocks invalid",
                        req_id,
                        xfer_state,
                    )
                    self._handle_failed_transfer(req_id, handle)
                    failed = True
            meta = self._recving_metadata.get(req_id)
            if in_progress and not failed:
                # A READ that hangs (a peer that stopped answering) would keep
                # its request waiting, and its blocks held, for good.
                posted = self._recv_posted.get(req_id, now)
                if now - posted > self.kv_read_timeout or (
                    meta is not None
                    and _wall_time() >= meta.remote.expiration_time - self.kv_expiry_margin
                ):
                    in_progress = self._abandon_transfers(req_id, in_progress, now - posted)
                    if not in_progress:
                        failed = True
            elif not in_progress and not failed and meta is not None:
                # Done, but maybe only after the producer freed the blocks:
                # this step cannot tell when the READ ended, so it must have
                # been seen to end before the producer's expiry.
                failed = self._is_expired(req_id, meta)
            if failed:
                del self._recving_transfers[req_id]  # reported as failed
                self._recv_posted.pop(req_id, None)
            elif not in_progress:
                done_req_ids.add(req_id)
                del self._recving_transfers[req_id]
                self._recv_posted.pop(req_id, None)
            else:
                self._recving_transfers[req_id] = in_progress
        return done_req_ids

    def _abandon_transfers(self, req_id: ReqId, handles: list[Any], waited: float) -> list[Any]:
        """Release READs still in progress (NIXL cancels them) and fail the
        request. A handle NIXL will not release is kept and retried next
        step: its READ could still write into the request's blocks, which must
        not go to another request before it stops. Returns the handles kept."""
        kept = []
        for handle in handles:
            try:
                self.nixl_wrapper.release_xfer_handle(handle)
            except Exception as e:
                logger.warning("NixlConnector: cannot release request %s's READ yet: %s", req_id, e)
                kept.append(handle)
        if not kept:
            logger.error(
                "NixlConnector: request %s's READ still in progress after %.1f s "
                "(kv_read_timeout %.1f s, or the producer's expiry near): abandoned, "
                "marking its blocks invalid",
                req_id,
                waited,
                self.kv_read_timeout,
            )
            self._handle_failed_transfer(req_id, None)
        return kept

    # -------------------------------------------------------------- finished
    def get_finished(self) -> tuple[set[str], set[str]]:
        """(requests whose blocks were read or expired, requests whose reads
        ended), this step."""
        done_sending = self._get_new_notifs() | self._done_sending_early
        self._done_sending_early = set()
        done_recving = self._pop_done_transfers()
        failed_recv_reqs: set[ReqId] = set()
        while not self._failed_recv_reqs.empty():
            failed_recv_reqs.add(self._failed_recv_reqs.get_nowait())
        done_recving |= failed_recv_reqs
        for req_id in done_recving:
            meta = self._recving_metadata.pop(req_id, None)
            if meta is not None:  # None: one of the scheduler's reqs_to_fail
                self._record_load(req_id, meta, failed=req_id in failed_recv_reqs)

        # Blocks no one came for are freed after the timeout.
        now = time.perf_counter()
        while self._reqs_to_send:
            req_id, expires = next(iter(self._reqs_to_send.items()))
            if now < expires:
                break  # oldest first
            logger.warning(
                "Releasing expired KV blocks for request %s which were "
                "not retrieved by a remote worker within %d seconds.",
                req_id,
                envs.TRACEVLLM_NIXL_ABORT_REQUEST_TIMEOUT,
            )
            del self._reqs_to_send[req_id]
            self._finish_send(req_id, "expired: no remote worker read the blocks")
            done_sending.add(req_id)
        timeout = envs.TRACEVLLM_NIXL_ABORT_REQUEST_TIMEOUT
        for key, arrived in list(self._early_notifs.items()):
            if now - arrived > timeout:
                del self._early_notifs[key]
        return done_sending, done_recving

    def _get_new_notifs(self) -> set[str]:
        """Requests a reader has finished reading."""
        notified_req_ids: set[str] = set()
        for notifs in self.nixl_wrapper.get_new_notifs().values():
            for notif in notifs:
                parsed = parse_notif(notif)
                if parsed is None:
                    self._peer_warnings.warn(
                        "malformed", "NixlConnector: dropped a malformed notification %.80r", notif
                    )
                    continue
                req_id, token = parsed
                if req_id in self._reqs_to_send:
                    send = self._send_meta.get(req_id)
                    if send is None or not hmac.compare_digest(
                        token.encode(), send.notif_token.encode()
                    ):
                        # Not from a reader given this request's params: it
                        # must not free blocks another reader may be reading.
                        self._peer_warnings.warn(
                            "wrong-token",
                            "NixlConnector: notification for request %.80r with the wrong "
                            "token: its blocks stay held",
                            req_id,
                        )
                        continue
                    del self._reqs_to_send[req_id]
                    self._finish_send(req_id, None)
                    notified_req_ids.add(req_id)
                elif is_notif_token(token):
                    # Read before this worker heard the request finished (or
                    # after it expired): matched in start_load_kv, if it comes.
                    # Bounded, oldest dropped: a peer could send any number;
                    # kept by the id's digest: a client's id can be any length.
                    if len(self._early_notifs) >= MAX_EARLY_NOTIFS:
                        del self._early_notifs[next(iter(self._early_notifs))]
                    self._early_notifs[(id_digest(req_id), token)] = time.perf_counter()
                else:
                    self._peer_warnings.warn(
                        "unknown",
                        "NixlConnector: dropped a notification for unknown request %.80r "
                        "whose token is not one this engine makes",
                        req_id,
                    )
        return notified_req_ids

    def get_block_ids_with_load_errors(self) -> set[int]:
        invalid: set[int] = set()
        while not self._invalid_block_ids.empty():
            invalid |= self._invalid_block_ids.get_nowait()
        return invalid

    # ----------------------------------------------------------------- spans
    def _record_load(self, req_id: ReqId, meta: ReqMeta, failed: bool) -> None:
        num_blocks = len(meta.local_block_ids)
        record = kv_transfer_tracing.KVTransferRecord(
            connector=CONNECTOR_NAME,
            direction="load",
            request_id=req_id,
            trace_headers=meta.trace_headers,
            num_blocks=num_blocks,
            num_tokens=num_blocks * self.block_size,
            remote_trace_headers=meta.remote_trace_headers,
        )
        start_ns = self._recv_start_ns.pop(req_id, time.time_ns())
        if failed:
            record.error = "NIXL read failed: blocks marked invalid"
            record.start_ns, record.end_ns = start_ns, time.time_ns()
        else:
            record.add(num_blocks * sum(self.block_lens), start_ns, time.time_ns())
            record.num_layers = self.num_layers
        kv_transfer_tracing.record_kv_transfer(record)

    def _finish_send(self, req_id: ReqId, error: str | None) -> None:
        send = self._send_meta.pop(req_id, None)
        if send is None:
            return
        record = kv_transfer_tracing.KVTransferRecord(
            connector=CONNECTOR_NAME,
            direction="save",
            request_id=req_id,
            trace_headers=send.trace_headers,
            num_blocks=send.num_blocks,
            num_tokens=send.num_tokens,
        )
        end_ns = time.time_ns()
        if error is None:
            record.add(send.num_blocks * sum(self.block_lens), send.start_ns, end_ns)
            record.num_layers = self.num_layers
        else:
            record.error = error
            record.start_ns, record.end_ns = send.start_ns, end_ns
        kv_transfer_tracing.record_kv_transfer(record)

    # -------------------------------------------------------------- shutdown
    def shutdown(self) -> None:
        """Stop the side channel, drop remote agents, deregister the KV cache."""
        self._stop_listener.set()
        if self._nixl_handshake_listener_t is not None:
            self._nixl_handshake_listener_t.join(timeout=5)
            self._nixl_handshake_listener_t = None
        # Waits for a handshake in flight (bounded by HANDSHAKE_TIMEOUT_MS), so
        # that it cannot add a remote agent after they are removed below.
        self._handshake_initiation_executor.shutdown(wait=True, cancel_futures=True)
        for handles in self._recving_transfers.values():
            for handle in handles:
                with contextlib.suppress(Exception):
                    self.nixl_wrapper.release_xfer_handle(handle)
        self._recving_transfers.clear()
        self._recv_posted.clear()
        retired_handles = [handle for _, handle in self._retired_remote]
        for handle in [
            self.src_xfer_side_handle,
            *self.dst_xfer_side_handles.values(),
            *retired_handles,
        ]:
            if handle is not None:
                with contextlib.suppress(Exception):
                    self.nixl_wrapper.release_dlist_handle(handle)
        self.src_xfer_side_handle = None
        self.dst_xfer_side_handles.clear()
        retired_agents = [name for name, _ in self._retired_remote]
        for agent_name in {*self._remote_agents.values(), *retired_agents}:
            with contextlib.suppress(Exception):
                self.nixl_wrapper.remove_remote_agent(agent_name)
        self._remote_agents.clear()
        self._retired_remote.clear()
        if self._registered_descs is not None:
            with contextlib.suppress(Exception):
                self.nixl_wrapper.deregister_memory(self._registered_descs)
            self._registered_descs = None


@contextlib.contextmanager
def _zmq_req_socket(path: str) -> Any:
    """A REQ socket to ``path`` that gives up after HANDSHAKE_TIMEOUT_MS."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, HANDSHAKE_TIMEOUT_MS)
    sock.setsockopt(zmq.SNDTIMEO, HANDSHAKE_TIMEOUT_MS)
    sock.connect(path)
    try:
        yield sock
    finally:
        sock.close()
        ctx.term()
