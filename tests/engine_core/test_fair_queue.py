"""The fair policy's waiting queue: per-tenant FIFOs served by deficit round robin."""
import random

import pytest

from engine_core.fair_queue import FairQueue
from tests.engine_core.factories import make_request

_ids = iter(range(10**9))


def req(tenant, num_tokens=4, weight=1.0):
    return make_request(f"r{next(_ids)}", num_tokens, tenant=tenant, tenant_weight=weight)


def admit_many(queue, num_admissions, cost_of, refill):
    """Serve ``num_admissions`` heads, charging ``cost_of(request)``; ``refill(tenant)``
    queues a replacement so every tenant stays backlogged. Tokens granted per tenant."""
    granted = {}
    for _ in range(num_admissions):
        request = queue.peek()
        cost = cost_of(request)
        queue.take(request, cost)
        granted[request.tenant] = granted.get(request.tenant, 0) + cost
        refill(request.tenant)
        queue.check_invariants()
    return granted


@pytest.mark.parametrize("weights", [{"a": 1.0, "b": 1.0}, {"a": 2.0, "b": 1.0},
                                     {"a": 1.0, None: 3.0, "c": 0.5}])
@pytest.mark.parametrize("base_quantum", [16, 2048])
def test_admitted_token_shares_follow_the_weights(weights, base_quantum):
    rng = random.Random(7)
    queue = FairQueue(base_quantum, weight_of=weights.__getitem__)
    for tenant in weights:
        for _ in range(3):
            queue.add(req(tenant))
    # Grants vary widely (a grant is what the step's budget allowed), and tenant "a"
    # always asks for the most: plain round robin over requests would favour it.
    def cost_of(request):
        return rng.randint(256, 1024) if request.tenant == "a" else rng.randint(1, 512)

    granted = admit_many(queue, 4000, cost_of, lambda t: queue.add(req(t)))
    total_granted, total_weight = sum(granted.values()), sum(weights.values())
    for tenant, weight in weights.items():
        share = granted[tenant] / total_granted
        assert share == pytest.approx(weight / total_weight, rel=0.10), (tenant, granted)


def test_tenant_whose_queue_empties_forgets_its_deficit():
    queue = FairQueue(100, weight_of=lambda t: 1.0)
    a1, a2, b1 = req("a"), req("a"), req("b")
    for r in (a1, a2, b1):
        queue.add(r)
    assert queue.peek() is a1
    queue.take(a1, 1000)  # a's deficit: 100 - 1000
    assert queue.deficit("a") == -900
    queue.remove(a2)  # an abort empties a's FIFO
    assert queue.deficit("a") is None and queue.tenants() == ["b"]
    a3 = req("a")
    queue.add(a3)  # back with a clean slate, behind b
    assert queue.deficit("a") == 0 and queue.tenants() == ["b", "a"]
    queue.take(queue.peek(), 500)  # b's turn: +100, then -500
    assert queue.peek() is a3  # a needs one quantum, not ten


def test_per_tenant_fifo_and_add_front():
    queue = FairQueue(10, weight_of=lambda t: 1.0)
    a1, a2, b1, a0 = req("a"), req("a"), req("b"), req("a")
    for r in (a1, a2, b1):
        queue.add(r)
    queue.add_front(a0)  # a preempted request goes before its tenant's newcomers
    assert list(queue.waiting_of("a")) == [a0, a1, a2]
    order = []
    while queue:
        request = queue.peek()
        queue.take(request, 10)  # each admission spends exactly one quantum
        order.append(request)
    assert order == [a0, b1, a1, a2]


def test_queue_contract_len_tokens_iteration_remove():
    queue = FairQueue(8, weight_of=lambda t: 1.0)
    a1, a2, b1, n1 = req("a", 3), req("a", 5), req("b", 7), req(None, 2)
    for r in (a1, a2, b1, n1):
        queue.add(r)
    assert len(queue) == 4 and queue.num_tokens == 17
    assert list(queue) == [a1, b1, n1, a2]  # round robin in turn order
    assert a2 in queue and req("a") not in queue
    queue.remove(b1)
    assert len(queue) == 3 and queue.num_tokens == 10 and b1 not in queue
    with pytest.raises(ValueError):
        queue.remove(b1)
    assert queue.pop() is a1
    assert queue.tenants() == ["a", None] or queue.tenants() == [None, "a"]
    queue.check_invariants()
    with pytest.raises(IndexError):
        FairQueue(8).peek()


def test_passed_over_tenant_keeps_its_turn():
    queue = FairQueue(100, weight_of=lambda t: 1.0)
    a1, a2, b1, b2 = req("a"), req("a"), req("b"), req("b")
    for r in (a1, a2, b1, b2):
        queue.add(r)
    # a's turn, but a cannot be served this step: b goes out of turn and pays for it
    assert queue.peek_among(exclude={"a"}) is b1
    queue.take(b1, 300)
    assert queue.peek_among(exclude={"a", "b"}) is None
    assert queue.peek() is a1  # a's turn is still open
    queue.take(a1, 150)
    assert queue.peek() is a2  # b has -300 to work off: a is served again
    queue.check_invariants()


def test_tiny_weight_costs_no_idle_rounds():
    calls = []

    def weight_of(tenant):
        calls.append(tenant)
        if len(calls) > 1000:
            raise AssertionError("crediting quanta one round at a time")
        return 1e-9 if tenant == "slow" else 1.0

    queue = FairQueue(1, weight_of=weight_of)
    for _ in range(2):
        queue.add(req("slow"))
        queue.add(req("fast"))
    queue.take(queue.peek(), 10**6)  # slow's turn: it now owes 10**6 tokens
    queue.take(queue.peek(), 10**6)  # fast's too
    assert queue.deficit("slow") < -999_999 and queue.deficit("fast") < -999_998
    # fast needs 10**6 quanta of 1 token; slow would need 10**15 of 1e-9
    assert queue.peek().tenant == "fast"
    assert queue.deficit("fast") > 0
    queue.check_invariants()


def test_weights_default_to_the_head_request():
    queue = FairQueue(100)
    for _ in range(50):
        queue.add(req("heavy", weight=3.0))
        queue.add(req("light", weight=1.0))
    granted = admit_many(queue, 40, lambda r: 50, lambda t: None)
    assert granted["heavy"] == pytest.approx(3 * granted["light"], rel=0.1)


def test_rejects_a_non_positive_base_quantum():
    with pytest.raises(ValueError):
        FairQueue(0)
