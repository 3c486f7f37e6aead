"""Lab 15: the offload tier's lookup. Your version of
``OffloadingConnectorScheduler._lookup``, the OffloadingConnector's question
"how much of this request's prompt, past the engine's own prefix-cache hit,
does the CPU tier hold?".

Read README.md first. Test it with ``make lab CH=15``; plug it into the
engine with ``TRACEVLLM_LAB=15`` and a CPU tier (``--kv-offloading-size``):
every request the scheduler admits is then looked up with your function.

It is written as a plain function whose first argument is the
``OffloadingConnectorScheduler``: the engine installs it as the method.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # not at run time: this file is loaded while that module is
    from tracevllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
        OffloadingConnectorScheduler,
        RequestOffloadState,
    )


def _lookup(self: OffloadingConnectorScheduler, req_status: RequestOffloadState) -> int | None:
    """Tokens past the local hit the tier can supply (0: none worth a load)."""
    # What you have:
    #   self.block_size                        tokens per block
    #   self.load_async                        vLLM's asynchronous loads (True) or not
    #   self.manager.lookup(key, req_context)  True: in the tier and readable; False:
    #                                          not there; None: being written (ask later)
    #   self._blocks_being_loaded              keys another request is loading right now
    #   req_status.req.num_tokens              the request's tokens (prompt, then outputs)
    #   req_status.offload_keys                one key per full block of the request, in order
    #   req_status.num_locally_computed_tokens the engine's own prefix-cache hit (whole blocks)
    #   req_status.req_context                 what the manager wants with every call
    # TODO 1: the most tokens a load may cover: every full block before the last
    #         token (synchronous loads), or every full block (asynchronous loads);
    #         never more blocks than the request has keys.
    # TODO 2: less than one block past the local hit: return 0 (computing it is cheaper).
    # TODO 3: the keys to ask about: from the first block past the local hit,
    #         up to that most.
    # TODO 4: count the consecutive hits from the first of them; an answer None
    #         counts as a hit so the walk goes on to the first miss, but then
    #         the whole answer is None (ask again next step).
    # TODO 5: no hit: 0. A hit block that another request is loading right now:
    #         None (wait for that load, then find the block in the prefix cache).
    # TODO 6: return the hit as tokens past the local hit.
    raise NotImplementedError("Lab 15: the offload tier's lookup (see chapters/15-offload-lookup)")
