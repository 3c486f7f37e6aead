"""rich views of what the engine did, drawn from span attributes.

The engine never imports this package: it only puts data on spans
(``tracevllm.view.*`` attributes). The same renderers draw a live run (through
a span processor) and a saved ``spans.jsonl`` (``tracevllm view``).
"""
