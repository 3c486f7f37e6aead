"""Disaggregated serving: prefill on one server, decode on another (vllm/entrypoints/serve/disagg/).

vLLM's package of that name holds the tokens-in, tokens-out endpoint its
routers drive; the proxy that splits an OpenAI request in two, which vLLM
keeps in its examples, is here: ``proxy.py`` (``tracevllm disagg-proxy``).
"""
