"""torch.compile for tracevllm's models: vLLM's compiled path, small.

Mirrors vllm/compilation/ (``decorators.py``, ``wrapper.py``, ``backends.py``,
``piecewise_backend.py``, ``compiler_interface.py``, ``caching.py``,
``counter.py``) and vllm/config/compilation.py (here ``config.py``). The
model's ``forward`` is captured once by Dynamo, the graph is split at the
attention ops (a registered custom op, ``torch.ops.tracevllm.*``), each piece
between two attentions is compiled by Inductor, and the compiled pieces are
kept on disk so that the next start skips Inductor.

This package's ``__init__`` imports nothing: ``config.py`` is read by the
frontend (which never imports torch for a config), the rest only when a model
is built for compilation.
"""
