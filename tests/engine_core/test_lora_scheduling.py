"""LoRA in the engine core: parking while adapters load, max_loras per step without
starvation, the host cache (max_cpu_loras, drains, in-use adapters kept), unloading."""
import pytest

from engine_core.lora_registry import UnknownLoRAError
from engine_core.outputs import FinishReason
from engine_core.request import RequestStatus
from engine_core.sampling_params import InvalidRequestError, SamplingParams
from tests.engine_core.factories import make_engine, run_to_completion
from tests.engine_core.fake_executor import reference_output
from tests.engine_core.fake_lora_worker import make_lora_engine


def prompt(i: int, n: int = 6) -> list[int]:
    return [(i * 13 + k) % 90 + 1 for k in range(n)]


def add(engine, req_id: str, lora_id: int, i: int = 0, max_tokens: int = 4) -> None:
    engine.add_request(req_id, prompt(i), SamplingParams(max_tokens=max_tokens),
                       lora_id=lora_id)


class Outputs(dict):
    """Every output of the engine's steps, by request id (manual steps and the rest)."""

    def step(self, engine) -> list:
        outs = engine.step()
        for out in outs:
            self.setdefault(out.req_id, []).append(out)
        return outs

    def finish(self, engine) -> "Outputs":
        for req_id, outs in run_to_completion(engine).items():
            self.setdefault(req_id, []).extend(outs)
        return self

    def tokens(self, req_id: str) -> list[int]:
        return [t for o in self[req_id] for t in o.new_token_ids]


def test_a_request_waits_for_its_adapter_while_others_run():
    engine = make_lora_engine(is_instant=False)
    worker = engine.lora_executor
    add(engine, "base", 0, 0, max_tokens=8)
    add(engine, "lora", 1, 1)
    outputs = Outputs()
    for _ in range(2):
        assert [o.req_id for o in outputs.step(engine)] == ["base"]
    lora = engine.scheduler.requests["lora"]
    assert lora.status is RequestStatus.WAITING_FOR_LORA
    assert [load.lora_id for load in worker.pending] == [1]
    stats = engine.get_stats()
    assert (stats.num_waiting, stats.lora.waiting, stats.lora.running) == (1, ["a0"], [])
    worker.finish()
    outputs.finish(engine)
    assert outputs.tokens("lora") == reference_output(prompt(1), 4)
    assert outputs.tokens("base") == reference_output(prompt(0), 8)
    assert engine.executor.step_loras[-1] <= {1}


@pytest.mark.parametrize("policy", ["fcfs", "priority", "fair"])
def test_at_most_max_loras_per_step_and_every_request_finishes(policy):
    engine = make_lora_engine(num_adapters=4, max_loras=2, policy=policy)
    for i in range(16):
        add(engine, f"r{i}", i % 5, i)  # adapters 1..4 and the base model, interleaved
    outputs = Outputs()
    outputs.step(engine)  # base requests run while the four adapters load
    outputs.step(engine)
    stats = engine.get_stats().lora
    assert len(stats.running) == 2 and set(stats.waiting) - set(stats.running)
    outputs.finish(engine)
    for i in range(16):
        assert outputs.tokens(f"r{i}") == reference_output(prompt(i), 4)
    assert max(len(s) for s in engine.executor.step_loras) == 2  # checked <= 2 each step


@pytest.mark.parametrize("policy", ["fcfs", "priority", "fair"])
def test_a_request_refused_a_slot_is_not_starved(policy):
    # One slot, adapter 1 busy with a stream of new requests: the adapter-2 request
    # that arrived in between must start before any adapter-1 request that came later
    # (both adapters loaded; while one loads, later requests may pass: it waits for
    # its load without blocking them).
    engine = make_lora_engine(num_adapters=2, max_loras=1, policy=policy)
    add(engine, "warm", 2, 50, max_tokens=1)
    add(engine, "first", 1, 0, max_tokens=6)
    Outputs().finish(engine)
    add(engine, "first", 1, 0, max_tokens=6)
    engine.step()
    add(engine, "victim", 2, 1)
    started: dict[str, int] = {}
    for step in range(60):
        add(engine, f"late{step}", 1, step + 2, max_tokens=6)
        engine.step()
        for req_id, request in engine.scheduler.requests.items():
            if request.status is RequestStatus.RUNNING:
                started.setdefault(req_id, step)
        if "victim" in started:
            break
    assert "victim" in started, "the adapter-2 request never got a slot"
    assert all(started[r] >= started["victim"] for r in started if r.startswith("late"))
    run_to_completion(engine)


def test_the_host_cache_holds_max_cpu_loras_and_never_evicts_in_use_adapters():
    engine = make_lora_engine(num_adapters=4, max_loras=2, max_cpu_loras=2)
    worker = engine.lora_executor
    apply = worker.apply_lora_commands

    def checked(commands):  # an evicted adapter has no queued or running request
        live = [*engine.scheduler.running, *engine.scheduler.waiting]
        assert not {r.lora_id for r in live} & set(commands.evictions)
        apply(commands)
    worker.apply_lora_commands = checked
    outputs = Outputs()
    for turn in range(2):  # the four adapters in turn, twice
        for i in range(4):
            add(engine, f"t{turn}-{i}", i + 1, i, max_tokens=3)
            add(engine, f"t{turn}-{i}b", i + 1, i + 7, max_tokens=3)
        outputs.finish(engine)
    for turn in range(2):
        for i in range(4):
            assert outputs.tokens(f"t{turn}-{i}") == reference_output(prompt(i), 3)
            assert outputs.tokens(f"t{turn}-{i}b") == reference_output(prompt(i + 7), 3)
    assert len(worker.loads) >= 6 and len(worker.evictions) >= 4  # the second turn reloads


def test_a_full_cache_of_busy_adapters_drains_for_a_new_one():
    engine = make_lora_engine(num_adapters=3, max_loras=2, max_cpu_loras=2,
                              max_num_seqs=16)
    for step in range(40):
        for lora_id in (1, 2):  # both cached adapters stay busy for as long as we go
            add(engine, f"busy{step}-{lora_id}", lora_id, step, max_tokens=3)
        if step == 2:
            add(engine, "newcomer", 3, 99)
        engine.step()
        if step > 2 and "newcomer" not in engine.scheduler.requests:
            break
    else:
        raise AssertionError("the newcomer's adapter never loaded")
    assert engine.lora_executor.evictions  # one of the busy adapters drained
    run_to_completion(engine)


def test_unloading_lets_requests_finish_and_ids_are_never_reused():
    engine = make_lora_engine()
    add(engine, "running", 1, 0, max_tokens=6)
    outputs = Outputs()
    outputs.step(engine)
    outputs.step(engine)
    assert engine.scheduler.requests["running"].status is RequestStatus.RUNNING
    engine.lora.unregister("a0")
    with pytest.raises(UnknownLoRAError):
        add(engine, "new", 1)
    with pytest.raises(UnknownLoRAError):
        engine.lora.lora_id_of("a0")
    outputs.finish(engine)
    assert outputs.tokens("running") == reference_output(prompt(0), 6)
    assert 1 in engine.lora_executor.evictions and 1 not in engine.lora.registry.by_id
    again = engine.lora.register("a0", "/adapters/a0")
    assert again.lora_id not in (1, 2, 3, 4) and engine.lora.lora_id_of("a0") == again.lora_id


def test_a_failed_reload_refuses_the_requests_waiting_for_it():
    engine = make_lora_engine(is_instant=False)
    engine.lora_executor.failing.add(2)
    add(engine, "doomed", 2, 0)
    add(engine, "base", 0, 1)
    outputs = Outputs()
    outputs.step(engine)
    engine.lora_executor.finish()
    outputs.finish(engine)
    assert outputs["doomed"][-1].finish_reason is FinishReason.ABORT
    assert outputs.tokens("doomed") == []
    assert outputs.tokens("base") == reference_output(prompt(1), 4)
    assert engine.lora.registry.num_load_failures == 1


def test_lora_ids_need_lora_on_and_a_known_adapter():
    with pytest.raises(InvalidRequestError) as err:
        make_engine().validate_request([1, 2], lora_id=1)
    assert err.value.param == "lora_id" and "lora.enable_lora" in str(err.value)
    with pytest.raises(UnknownLoRAError):
        make_lora_engine(num_adapters=2).validate_request([1, 2], lora_id=3)


def test_the_samples_of_an_n2_request_wait_for_their_adapter_together():
    engine = make_lora_engine(is_instant=False)
    engine.add_request("pair", prompt(3), SamplingParams(max_tokens=4, n=2), lora_id=2)
    outputs = Outputs()
    outputs.step(engine)
    assert {r.status for r in engine.scheduler.requests.values()} == {
        RequestStatus.WAITING_FOR_LORA, RequestStatus.WAITING_FOR_FORK}
    engine.lora_executor.finish()
    outputs.finish(engine)
    assert outputs.tokens("0_pair") == outputs.tokens("1_pair") == reference_output(prompt(3), 4)
    assert engine.lora.registry.by_id[2].num_requests == 0


def test_under_fair_another_tenant_cannot_hold_the_slot_for_ever():
    # fair: the victim's tenant is refused a slot; without the step's gate closing, the
    # other tenant's adapter-1 stream would be admitted behind it, step after step
    engine = make_lora_engine(num_adapters=2, max_loras=1, policy="fair", max_num_seqs=16)
    for lora_id in (1, 2):  # both adapters loaded
        engine.add_request(f"warm{lora_id}", prompt(50), SamplingParams(max_tokens=1),
                           lora_id=lora_id)
    Outputs().finish(engine)

    def add_as(tenant, req_id, lora_id, i):
        engine.add_request(req_id, prompt(i), SamplingParams(max_tokens=6), lora_id=lora_id,
                           tenant=tenant)
    add_as("t2", "first", 1, 0)
    engine.step()
    assert engine.scheduler.requests["first"].status is RequestStatus.RUNNING
    add_as("t1", "victim", 2, 1)
    for step in range(60):
        add_as("t2", f"late{step}", 1, step + 2)
        engine.step()
        if engine.scheduler.requests["victim"].status is RequestStatus.RUNNING:
            break
    else:
        raise AssertionError("the other tenant's stream kept the only slot")
    run_to_completion(engine)
