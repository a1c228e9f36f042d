"""The waiting queue, ordered by the scheduling policy."""
from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator

from engine_core.request import Request


class RequestQueue:
    """Waiting requests in service order.

    ``fcfs``: arrival order, with ``add_front`` for requests that already waited their
    turn (preempted ones, forked samples). ``priority``: ordered by
    (priority, arrival_time, arrival_seq), lowest first, whatever the insertion call;
    a preempted request therefore returns to the place its key gives it.

    ``num_tokens`` is the sum of the queued requests' ``num_tokens`` (backpressure reads
    it). A request's token count cannot change while it waits (tokens are appended only
    to running requests), so adding it on the way in and subtracting it on the way out
    keeps the sum exact.
    """

    def __init__(self, policy: str = "fcfs"):
        if policy not in ("fcfs", "priority"):
            raise ValueError(f"unknown scheduling policy {policy!r}")
        self.policy = policy
        self._deque: deque[Request] = deque()
        self._heap: list[tuple[tuple[int, float, int], Request]] = []
        self.num_tokens = 0

    @staticmethod
    def _key(request: Request) -> tuple[int, float, int]:
        return (request.priority, request.arrival_time, request.arrival_seq)

    def add(self, request: Request) -> None:
        """Queue a request in its policy order (fcfs: at the back)."""
        self.num_tokens += request.num_tokens
        if self.policy == "fcfs":
            self._deque.append(request)
        else:
            heapq.heappush(self._heap, (self._key(request), request))

    def add_front(self, request: Request) -> None:
        """Queue a request that should be served before newcomers."""
        self.num_tokens += request.num_tokens
        if self.policy == "fcfs":
            self._deque.appendleft(request)
        else:
            heapq.heappush(self._heap, (self._key(request), request))

    def peek(self) -> Request:
        """The request served next (IndexError when empty)."""
        if self.policy == "fcfs":
            return self._deque[0]
        return self._heap[0][1]

    def pop(self) -> Request:
        """Remove and return the request served next."""
        if self.policy == "fcfs":
            request = self._deque.popleft()
        else:
            request = heapq.heappop(self._heap)[1]
        self.num_tokens -= request.num_tokens
        return request

    def take(self, request: Request, num_tokens: int) -> None:
        """Remove ``request``, just admitted, which must be the one ``peek`` offered
        (``num_tokens``, its grant, matters only to the fair queue)."""
        if self.pop() is not request:
            raise RuntimeError("waiting queue changed order while admitting")

    def remove(self, request: Request) -> None:
        """Remove one request from anywhere in the queue (O(n), rare: aborts)."""
        if self.policy == "fcfs":
            self._deque.remove(request)
        else:
            self._remove_from_heap(request)
        self.num_tokens -= request.num_tokens

    def _remove_from_heap(self, request: Request) -> None:
        for i, (_, queued) in enumerate(self._heap):
            if queued is request:
                self._heap[i] = self._heap[-1]
                self._heap.pop()
                heapq.heapify(self._heap)
                return
        raise ValueError(f"request {request.req_id} is not waiting")

    def __contains__(self, request: Request) -> bool:
        return any(r is request for r in self)

    def __iter__(self) -> Iterator[Request]:
        """Requests in service order."""
        if self.policy == "fcfs":
            return iter(list(self._deque))
        return iter([r for _, r in sorted(self._heap, key=lambda item: item[0])])

    def __len__(self) -> int:
        return len(self._deque) if self.policy == "fcfs" else len(self._heap)

    def __bool__(self) -> bool:
        return len(self) > 0
