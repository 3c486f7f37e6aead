"""The waiting queue: first-come-first-served or by priority.

Mirrors vllm/v1/core/sched/request_queue.py (``SchedulingPolicy``,
``RequestQueue``, ``FCFSRequestQueue``, ``PriorityRequestQueue``,
``create_request_queue``). The abstract base is a ``Protocol`` here.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable, Iterator
from enum import Enum
from typing import Protocol

from tracevllm.request import Request


class SchedulingPolicy(Enum):
    FCFS = "fcfs"
    PRIORITY = "priority"


class RequestQueue(Protocol):
    def add_request(self, request: Request) -> None: ...
    def pop_request(self) -> Request: ...
    def peek_request(self) -> Request: ...
    def prepend_request(self, request: Request) -> None: ...
    def prepend_requests(self, requests: RequestQueue) -> None: ...
    def remove_request(self, request: Request) -> None: ...
    def remove_requests(self, requests: Iterable[Request]) -> None: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Request]: ...


class FCFSRequestQueue(deque[Request]):
    """Arrival order. A preempted request goes back to the front."""

    def add_request(self, request: Request) -> None:
        self.append(request)

    def pop_request(self) -> Request:
        return self.popleft()

    def peek_request(self) -> Request:
        if not self:
            raise IndexError("peek from an empty queue")
        return self[0]

    def prepend_request(self, request: Request) -> None:
        self.appendleft(request)

    def prepend_requests(self, requests: RequestQueue) -> None:
        # extendleft reverses: the last of `requests` ends up first (as vLLM).
        self.extendleft(requests)

    def remove_request(self, request: Request) -> None:
        self.remove(request)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        remove = set(requests)
        kept = [r for r in self if r not in remove]
        self.clear()
        self.extend(kept)


class PriorityRequestQueue:
    """A heap on ``Request.__lt__``: lower ``priority`` first, then earlier
    arrival. "Prepend" is just add: the heap decides the order."""

    def __init__(self) -> None:
        self._heap: list[Request] = []

    def add_request(self, request: Request) -> None:
        heapq.heappush(self._heap, request)

    def pop_request(self) -> Request:
        if not self._heap:
            raise IndexError("pop from empty heap")
        return heapq.heappop(self._heap)

    def peek_request(self) -> Request:
        if not self._heap:
            raise IndexError("peek from empty heap")
        return self._heap[0]

    def prepend_request(self, request: Request) -> None:
        self.add_request(request)

    def prepend_requests(self, requests: RequestQueue) -> None:
        for request in requests:
            self.add_request(request)

    def remove_request(self, request: Request) -> None:
        self._heap.remove(request)
        heapq.heapify(self._heap)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        remove = set(requests)
        self._heap = [r for r in self._heap if r not in remove]
        heapq.heapify(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        """In priority order (on a copy; the heap is left as it is)."""
        heap = self._heap[:]
        while heap:
            yield heapq.heappop(heap)


def create_request_queue(policy: SchedulingPolicy) -> RequestQueue:
    if policy == SchedulingPolicy.PRIORITY:
        return PriorityRequestQueue()
    if policy == SchedulingPolicy.FCFS:
        return FCFSRequestQueue()
    raise ValueError(f"Unknown scheduling policy: {policy}")
