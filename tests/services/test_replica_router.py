"""Data parallelism in the API process: the router's policies (replica_router.py) and
the merged /metrics text of several replicas (replica_metrics.py)."""
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from engine_core.block_hash import make_hash_fn, prompt_block_hashes
from engine_core.kv_events import KVCacheEvents
from services.api.replica_metrics import merge_metrics
from services.api.replica_router import ReplicaRouter

BLOCK = 4
HASH = make_hash_fn("sha256")


def router(policy="prefix_aware", n=2, max_imbalance=4) -> ReplicaRouter:
    return ReplicaRouter(n, policy, max_imbalance, BLOCK, HASH)


def test_prefix_aware_picks_the_longest_cached_prefix_then_the_lighter_load():
    r = router()
    prompt = list(range(100, 120))  # 5 blocks
    hashes = prompt_block_hashes(prompt, BLOCK, HASH)
    r.on_cache_events(0, KVCacheEvents(hashes[:2]))
    r.on_cache_events(1, KVCacheEvents(hashes[:4]))
    route = r.route(prompt, [0, 1])
    assert (route.replica, route.num_prefix_blocks) == (1, 4)
    r.finish(route)
    r.on_cache_events(1, KVCacheEvents(removed=[hashes[0]]))  # a chain breaks at its head
    assert r.route(prompt, [0, 1]).replica == 0
    # a miss everywhere: the replica with fewer requests in flight (0 has one)
    other = r.route(list(range(500, 520)), [0, 1])
    assert other.replica == 1 and other.num_prefix_blocks == 0
    assert r.route(prompt, [1]).replica == 1  # only live replicas are candidates


def test_requests_in_flight_hold_their_prefix_before_it_is_cached():
    r = router()
    prompt = list(range(100, 120))
    first = r.route(prompt, [0, 1])
    r.route(list(range(300, 320)), [0, 1])  # the other replica gets the other prefix
    again = r.route(prompt + [7], [0, 1])
    assert again.replica == first.replica and again.num_prefix_blocks == 5
    r.finish(first)
    r.finish(again)
    assert not r.replicas[first.replica].pending  # no cache events came: nothing held
    assert r.route(prompt, [0, 1]).num_prefix_blocks == 0


def test_imbalance_cap_sends_to_the_least_loaded_replica():
    r = router(max_imbalance=2)
    prompt = list(range(100, 120))
    r.on_cache_events(0, KVCacheEvents(prompt_block_hashes(prompt, BLOCK, HASH)))
    picks = [r.route(prompt + [i], [0, 1]).replica for i in range(6)]
    # 0 leads by 3 > 2 after three: the least loaded wins, and from then on replica 1
    # holds the prefix too (its request in flight), so load breaks the tie
    assert picks == [0, 0, 0, 1, 1, 1]
    assert r.num_imbalance_overrides == 1


def test_salted_and_lora_requests_and_other_policies():
    r = router()
    prompt = list(range(100, 120))
    r.on_cache_events(1, KVCacheEvents(prompt_block_hashes(prompt, BLOCK, HASH)))
    assert r.route(prompt, [0, 1], cache_salt="t").num_prefix_blocks == 0  # another tenant
    assert r.route(prompt, [0, 1], lora_name="a").replica == 1  # least loaded (0 has 1)
    r.on_cache_events(1, KVCacheEvents(is_cleared=True))
    assert not r.replicas[1].cached
    rr = router("round_robin", n=3)
    assert [rr.route(prompt, [0, 1, 2]).replica for _ in range(4)] == [0, 1, 2, 0]
    ll = router("least_loaded")
    a = ll.route(prompt, [0, 1])
    assert [a.replica, ll.route(prompt, [0, 1]).replica] == [0, 1]
    ll.finish(a)
    assert ll.loads() == [0, 1] and ll.route(prompt, [0, 1]).replica == 0


def replica_text(prompt_tokens: float, usage: float) -> str:
    reg = CollectorRegistry()
    Counter("folio:prompt_tokens", "Prompt \\ tokens", ["model_name"], registry=reg).labels(
        "m").inc(prompt_tokens)
    Gauge("folio:kv_cache_usage_perc", "Usage", ["model_name"], registry=reg).labels(
        "m").set(usage)
    return generate_latest(reg).decode()


def test_merged_metrics_label_each_replica_and_sum_or_average_them():
    text = merge_metrics([replica_text(10, 0.2), None, replica_text(30, 0.6)])
    samples = {(s.name, s.labels.get("replica")): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples[("folio:prompt_tokens_total", "0")] == 10
    assert samples[("folio:prompt_tokens_total", "2")] == 30
    assert samples[("folio:prompt_tokens_total", "all")] == 40
    assert abs(samples[("folio:kv_cache_usage_perc", "all")] - 0.4) < 1e-9
    assert [samples[("folio:replica_up", str(i))] for i in range(3)] == [1, 0, 1]
    assert ("folio:prompt_tokens_total", "1") not in samples
    assert "# HELP folio:prompt_tokens_total Prompt \\\\ tokens" in text


def test_the_request_span_names_the_replica_of_each_prompt():
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from engine_core.sampling_params import SamplingParams
    from services.api.request_trace import RequestTrace
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    spans = []
    for replicas in ([1], [0, 0], [0, 1], [None]):
        trace = RequestTrace(provider.get_tracer("t"), "text_completion", "m", "r", None,
                             SamplingParams())
        for r in replicas:
            trace.on_replica(r)
        trace.finish()
    spans = [s.attributes.get("folio.replica") for s in exporter.get_finished_spans()]
    assert spans == [1, 0, (0, 1), None]


def test_cache_events_cross_the_wire_as_bytes():
    from services.protocol import decode, encode
    events = KVCacheEvents([b"\x00" * 32, b"\xff" * 16], [b"x"], is_cleared=True)
    assert decode(encode(events)) == events
