"""Executors: how EngineCore reaches its workers (vllm/v1/executor/__init__.py)."""

from tracevllm.executor.abstract import Executor

__all__ = ["Executor"]
