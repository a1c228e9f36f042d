"""The waiting queue of the ``fair`` policy: one FIFO per tenant, deficit round robin.

Tenants with waiting work take turns. The front of the turn order is the tenant being
served; its turn opens by crediting its deficit with a quantum (its weight times the
base quantum, in tokens) and lasts while the deficit is positive. Each admission is
charged afterwards (``take``) with the tokens it was granted in its step; when the
deficit is spent the turn closes and the tenant goes to the back, carrying its
(non-positive) deficit into its next turn:

    turn order   [A] B C        A's turn is open: deficit_A += 2 x Q (weight 2)
    take(a1, 300)               deficit_A = 2Q - 300 > 0: still A's turn
    take(a2, 900)               deficit_A <= 0: A goes to the back
    turn order   [B] C A        B's turn opens: deficit_B += Q ...

Costs are known only after the fact (a grant depends on the step's budget), so a
deficit can dip below zero by at most one grant; over a run, tenants that stay
backlogged are granted tokens in proportion to their weights, to within one quantum
plus one grant each.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence

from engine_core.request import Request, Tenant


def _head_weight(fifo: deque[Request]) -> float:
    return fifo[0].tenant_weight


class FairQueue:
    """Waiting requests in one FIFO per tenant, admitted in weighted DRR order.

    Same contract as RequestQueue (``add``, ``add_front``, ``peek``, ``pop``,
    ``remove``, ``num_tokens``, ``len``, iteration) plus the tenant-aware calls the
    fair scheduler uses (``peek_among``, ``head``, ``take``). ``add_front`` puts a
    request at the front of its tenant's FIFO (preempted requests, forked samples).

    Invariants: ``_order`` holds exactly the tenants whose FIFO is non-empty, each
    once; a tenant whose FIFO empties leaves it and forgets its deficit (idle time
    earns no credit); every tenant but an open-turn front has a deficit <= 0; and
    ``num_tokens`` is the sum of the queued requests' ``num_tokens`` (exact for the
    reason RequestQueue gives: a waiting request's token count cannot change).
    """

    def __init__(self, base_quantum: float,
                 weight_of: Callable[[Tenant], float] | None = None):
        if not base_quantum > 0:
            raise ValueError(f"base_quantum must be positive, got {base_quantum}")
        self.base_quantum = float(base_quantum)
        # Default: a tenant weighs what its oldest waiting request says.
        self._weight_of = weight_of or (lambda t: _head_weight(self._fifos[t]))
        self._fifos: dict[Tenant, deque[Request]] = {}
        self._order: deque[Tenant] = deque()
        self._deficit: dict[Tenant, float] = {}
        self._is_turn_open = False  # whether _order[0] has been credited its quantum
        self._len = 0
        self.num_tokens = 0

    # ---- queue contract ------------------------------------------------------------

    def add(self, request: Request) -> None:
        """Queue a request at the back of its tenant's FIFO."""
        self._fifo_for(request.tenant).append(request)
        self._count_in(request)

    def add_front(self, request: Request) -> None:
        """Queue a request at the front of its tenant's FIFO (it already had a turn)."""
        self._fifo_for(request.tenant).appendleft(request)
        self._count_in(request)

    def peek(self) -> Request:
        """The request served next (IndexError when empty)."""
        request = self.peek_among()
        if request is None:
            raise IndexError("peek from an empty queue")
        return request

    def pop(self) -> Request:
        """Remove and return the request served next, charging nothing."""
        request = self.peek()
        self.take(request, 0)
        return request

    def remove(self, request: Request) -> None:
        """Remove one request from anywhere in the queue (aborts)."""
        fifo = self._fifos.get(request.tenant)
        if fifo is None or not any(r is request for r in fifo):
            raise ValueError(f"request {request.req_id} is not waiting")
        fifo.remove(request)
        self._count_out(request)

    def __contains__(self, request: Request) -> bool:
        return any(r is request for r in self._fifos.get(request.tenant, ()))

    def __iter__(self) -> Iterator[Request]:
        """Requests round robin over tenants in turn order, one per tenant per round.

        This is the service order when every admission spends a whole turn; the real
        order depends on the tokens each admission is granted.
        """
        fifos = [list(self._fifos[t]) for t in self._order]
        depth = max(map(len, fifos), default=0)
        return iter([fifo[i] for i in range(depth) for fifo in fifos if i < len(fifo)])

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    # ---- tenant-aware calls ------------------------------------------------------

    def tenants(self) -> list[Tenant]:
        """Tenants with waiting work, in turn order (the front first)."""
        return list(self._order)

    def head(self, tenant: Tenant) -> Request:
        """The oldest waiting request of ``tenant`` (KeyError if it has none)."""
        return self._fifos[tenant][0]

    def waiting_of(self, tenant: Tenant) -> Sequence[Request]:
        """``tenant``'s waiting requests in FIFO order (a live view: do not mutate)."""
        return self._fifos.get(tenant, ())

    def deficit(self, tenant: Tenant) -> float | None:
        """``tenant``'s deficit in tokens; None once it has no waiting work."""
        return self._deficit.get(tenant)

    def peek_among(self, exclude: Iterable[Tenant] = ()) -> Request | None:
        """The head of the tenant to serve next: the one whose turn it is, or, when it
        is excluded (it cannot be served this step), the next in turn order that is
        not; None if every tenant is excluded (or none waits).

        A passed-over front keeps its open turn and its deficit, so it goes first as
        soon as it can be served; tenants served out of turn pay from their deficit.
        """
        if not self._order:
            return None
        self._open_turn()
        excluded = set(exclude)
        return next((self._fifos[t][0] for t in self._order if t not in excluded), None)

    def take(self, request: Request, num_tokens: int) -> None:
        """Remove ``request``, the head of its tenant's FIFO that the scheduler just
        admitted, and charge its tenant the ``num_tokens`` it was granted."""
        tenant = request.tenant
        fifo = self._fifos.get(tenant)
        if not fifo or fifo[0] is not request:
            raise RuntimeError("waiting queue changed order while admitting")
        fifo.popleft()
        self._count_out(request)
        if tenant not in self._deficit:
            return  # its FIFO emptied: it left the turn order and forgot its deficit
        self._deficit[tenant] -= num_tokens
        if self._is_turn_open and self._order[0] == tenant and self._deficit[tenant] <= 0:
            self._order.rotate(-1)
            self._is_turn_open = False

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping breaks the class invariants (tests)."""
        queued = [r for fifo in self._fifos.values() for r in fifo]
        assert list(self._order) == list(dict.fromkeys(self._order)), "tenant queued twice"
        assert set(self._order) == set(self._fifos) == set(self._deficit), "order != fifos"
        assert all(self._fifos.values()), "an empty FIFO kept its tenant"
        assert all(r.tenant == t for t, fifo in self._fifos.items() for r in fifo)
        assert self._len == len(queued), "length is off"
        assert self.num_tokens == sum(r.num_tokens for r in queued), "num_tokens is off"
        open_front = self._order[0] if self._is_turn_open else object()
        assert all(d <= 1e-6 * max(1.0, abs(d)) for t, d in self._deficit.items()
                   if t != open_front), "a tenant out of turn holds credit"
        if self._is_turn_open:
            assert self._deficit[self._order[0]] > 0, "an open turn without credit"

    # ---- DRR bookkeeping ---------------------------------------------------------

    def _fifo_for(self, tenant: Tenant) -> deque[Request]:
        fifo = self._fifos.get(tenant)
        if fifo is None:
            fifo = self._fifos[tenant] = deque()
            self._order.append(tenant)
            self._deficit[tenant] = 0.0
        return fifo

    def _count_in(self, request: Request) -> None:
        self._len += 1
        self.num_tokens += request.num_tokens

    def _count_out(self, request: Request) -> None:
        self._len -= 1
        self.num_tokens -= request.num_tokens
        tenant = request.tenant
        if self._fifos[tenant]:
            return
        del self._fifos[tenant], self._deficit[tenant]
        if self._order[0] == tenant:
            self._is_turn_open = False
        self._order.remove(tenant)

    def _quantum(self, tenant: Tenant) -> float:
        return self._weight_of(tenant) * self.base_quantum

    def _open_turn(self) -> None:
        """Ensure the front tenant has an open turn with a positive deficit."""
        if self._is_turn_open:
            return
        self._skip_idle_rounds()
        while True:
            front = self._order[0]
            self._deficit[front] += self._quantum(front)
            if self._deficit[front] > 0:
                self._is_turn_open = True
                return
            self._order.rotate(-1)

    def _skip_idle_rounds(self) -> None:
        """Credit whole rounds at once in which no tenant's deficit would turn positive.

        Every deficit is <= 0 here; tenant t needs floor(-d_t / q_t) + 1 quanta. Crediting
        everyone one round fewer than the smallest need leaves every deficit <= 0, and
        the loop in ``_open_turn`` then finds a positive one within one cycle, however
        small a weight makes a quantum.
        """
        quanta = {t: self._quantum(t) for t in self._order}
        num_rounds = min(int(-self._deficit[t] // q) for t, q in quanta.items())
        if num_rounds > 0:
            for tenant, quantum in quanta.items():
                self._deficit[tenant] += num_rounds * quantum
