"""msgpack encoding of the messages that cross the process boundary.

Mirrors vllm/v1/serial_utils.py (``MsgpackEncoder``, ``MsgpackDecoder``).
vLLM also sends tensors as (dtype, shape, data) with large ones as extra
zero-copy frames; no tensor crosses tracevllm's boundary yet, so the encoder
is msgspec's own. Messages are msgspec Structs, so the decoder is typed: a
malformed frame fails loudly instead of producing a half-filled object.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import zmq


class MsgpackEncoder:
    def __init__(self) -> None:
        self.encoder = msgspec.msgpack.Encoder()

    def encode(self, obj: Any) -> bytes:
        return self.encoder.encode(obj)


class MsgpackDecoder:
    def __init__(self, t: Any = Any) -> None:
        self.decoder = msgspec.msgpack.Decoder(t)

    def decode(self, bufs: bytes | zmq.Frame | Sequence[zmq.Frame] | Sequence[bytes]) -> Any:
        if isinstance(bufs, (list, tuple)):
            # One message is one frame here; vLLM appends tensor frames.
            bufs = bufs[0]
        if isinstance(bufs, zmq.Frame):
            return self.decoder.decode(bufs.buffer)
        return self.decoder.decode(bufs)  # type: ignore[arg-type]


def run_method(
    obj: Any,
    method: str | bytes | Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """``obj.method(*args, **kwargs)``, or ``method(obj, *args, **kwargs)`` for a
    function, which may come pickled (vLLM's; vLLM cloudpickles functions,
    tracevllm pickles them by reference, so a module-level function). A
    pickled function is loaded here, where a failure to load it (a module the
    receiving process cannot import) is the call's error, not the process's."""
    if isinstance(method, str):
        try:
            func = getattr(obj, method)
        except AttributeError:
            raise NotImplementedError(f"Method {method!r} is not implemented.") from None
        return func(*args, **kwargs)
    function: Callable[..., Any] = pickle.loads(method) if isinstance(method, bytes) else method
    return function(obj, *args, **kwargs)
