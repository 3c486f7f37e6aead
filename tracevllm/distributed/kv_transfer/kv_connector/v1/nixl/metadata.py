"""What the NixlConnector sends: per-step metadata, and the handshake on the side channel.

Mirrors vllm/distributed/kv_transfer/kv_connector/v1/nixl/metadata.py. The
handshake travels as msgpack (msgspec), never pickle: a decode engine's
worker asks a prefill engine's side channel for ``GET_META_MSG`` and gets a
``NixlHandshakePayload``, whose ``compatibility_hash`` it checks before it
decodes the ``NixlAgentMetadata`` inside (the NIXL agent's own metadata
blob, and where each layer's KV blocks lie in the prefill worker's memory).
Left out: heterogeneous tensor parallelism and block sizes, Mamba and
sliding-window sizes, heartbeats.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tracevllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

if TYPE_CHECKING:
    from tracevllm.config import VllmConfig

ReqId = str
EngineId = str

GET_META_MSG = b"get_meta_msg"
NIXL_CONNECTOR_VERSION: int = 1


@dataclass
class NixlAgentMetadata:
    """One prefill worker's NIXL agent and KV cache layout."""

    engine_id: str
    agent_metadata: bytes
    # Per layer (in the same order on both sides): the KV tensor's address.
    kv_caches_base_addr: list[int]
    num_blocks: int
    # Per layer: bytes of one block (K and V of block_size tokens).
    block_lens: list[int]
    block_size: int
    # tracevllm's: the key of the producer's kv_transfer_params MACs.
    params_key: bytes = b""


@dataclass
class NixlHandshakePayload:
    """The side channel's answer: decoded in two steps, so that an incompatible
    engine gives a clear error instead of a decode failure."""

    compatibility_hash: str
    agent_metadata_bytes: bytes  # NixlAgentMetadata, msgpack-encoded


def compute_nixl_compatibility_hash(vllm_config: VllmConfig) -> str:
    """SHA-256 of what must match for one engine to read another's KV blocks."""
    model_config = vllm_config.model_config
    factors = {
        "nixl_connector_version": NIXL_CONNECTOR_VERSION,
        "model": model_config.model,
        "dtype": str(model_config.dtype),
        "num_kv_heads": model_config.get_total_num_kv_heads(),
        "head_size": model_config.get_head_size(),
        "num_hidden_layers": model_config.get_total_num_hidden_layers(),
    }
    return hashlib.sha256(repr(sorted(factors.items())).encode()).hexdigest()


def compute_params_mac(
    key: bytes, request_id: str, block_ids: list[int], expiration_time: float, notif_token: str
) -> str:
    """tracevllm's: the producer's HMAC-SHA256 over what a reader of its
    ``kv_transfer_params`` must not be able to change (the request, its block
    ids, the expiry, the notification token), hex. The key is the producer's
    own, handed to readers on the side channel only, so a client that changes
    one of them (a replay with a fresh expiry) is found out before the READ."""
    msg = "|".join(
        (request_id, ",".join(map(str, block_ids)), repr(float(expiration_time)), notif_token)
    )
    return hmac.new(key, msg.encode(), hashlib.sha256).hexdigest()


# A remote engine as the consumer knows it: its id and its side channel's
# address (tracevllm's; vLLM keys remote agents by engine id alone).
RemoteAgentKey = tuple[EngineId, str, int]


@dataclass
class RemoteMeta:
    block_ids: list[int]
    host: str
    port: int
    engine_id: str
    request_id: str
    # tracevllm's: when the producer frees the blocks unread (Unix time, its
    # clock), and the token its notification must carry to free them.
    expiration_time: float = float("inf")
    notif_token: str = ""
    # The producer's compute_params_mac over the fields above.
    params_mac: str = ""

    @property
    def agent_key(self) -> RemoteAgentKey:
        return (self.engine_id, self.host, self.port)


@dataclass
class ReqMeta:
    local_block_ids: list[int]
    remote: RemoteMeta
    # The consumer's request's trace context, and the producer's (tracevllm's).
    trace_headers: dict[str, str] | None = None
    remote_trace_headers: dict[str, str] | None = None


@dataclass
class SendMeta:
    """tracevllm's: what the producer's worker needs for a send's span."""

    num_blocks: int
    num_tokens: int
    trace_headers: dict[str, str] | None = None
    start_ns: int = 0
    # The token a reader's notification must carry to free these blocks.
    notif_token: str = ""


class NixlConnectorMetadata(KVConnectorMetadata):
    def __init__(self) -> None:
        # Consumer: requests whose blocks to read this step.
        self.reqs_to_recv: dict[ReqId, ReqMeta] = {}
        # Consumer (tracevllm's): requests waiting for remote KV whose params
        # failed build_connector_meta's check, with their local blocks: the
        # worker reports each as a failed load, so that it is not stranded.
        self.reqs_to_fail: dict[ReqId, list[int]] = {}
        # Producer: finished requests whose blocks wait for a reader, with the
        # time (time.perf_counter) after which they are freed unread.
        self.reqs_to_send: dict[ReqId, float] = {}
        self.send_meta: dict[ReqId, SendMeta] = {}
        # Producer (tracevllm's): the key of its params' MACs, for its side channel.
        self.params_key = b""

    def add_new_req_to_recv(
        self,
        request_id: ReqId,
        local_block_ids: list[int],
        kv_transfer_params: dict[str, Any],
        trace_headers: dict[str, str] | None = None,
        remote_trace_headers: dict[str, str] | None = None,
    ) -> None:
        self.reqs_to_recv[request_id] = ReqMeta(
            local_block_ids=local_block_ids,
            remote=RemoteMeta(
                block_ids=list(kv_transfer_params["remote_block_ids"]),
                host=kv_transfer_params["remote_host"],
                port=kv_transfer_params["remote_port"],
                engine_id=kv_transfer_params["remote_engine_id"],
                request_id=kv_transfer_params["remote_request_id"],
                expiration_time=float(kv_transfer_params["remote_expiration_time"]),
                notif_token=kv_transfer_params["remote_notif_token"],
                params_mac=kv_transfer_params["remote_params_mac"],
            ),
            trace_headers=trace_headers,
            remote_trace_headers=remote_trace_headers,
        )
