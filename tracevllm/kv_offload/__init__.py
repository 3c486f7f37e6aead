"""KV offloading: a second tier for KV blocks, beside the engine's paged KV cache.

Mirrors vllm/v1/kv_offload/ (tracevllm drops the ``v1/`` level). The
scheduler side keeps an ``OffloadingManager`` (base.py) that knows which
block hashes the tier holds and where; the worker side moves the bytes with
``OffloadingHandler``\\ s (worker/worker.py). ``OffloadingSpec`` builds both
for one kind of tier (factory.py); the one tracevllm has is vLLM's
``CPUOffloadingSpec`` (cpu/): a preallocated host-memory region with its own
LRU. The ``OffloadingConnector``
(distributed/kv_transfer/kv_connector/v1/offloading_connector.py) wires it
into the engine through the KV connector interface.
"""
