"""ModelControl, the engine core's side of the RL hooks: requests refused while asleep or
while a sleep waits, in-flight requests aborted on demand, prefixes forgotten only when
no request holds blocks."""
import pytest

from engine_core.model_control import EngineSleepingError
from engine_core.outputs import FinishReason
from engine_core.sampling_params import SamplingParams
from tests.engine_core.factories import make_engine, run_to_completion


def test_sleep_refuses_requests_until_wake():
    engine = make_engine()
    control = engine.control
    control.is_sleep_pending = True
    with pytest.raises(EngineSleepingError, match="going to sleep"):
        engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=2))
    control.on_sleep(2)
    assert control.is_sleeping and not control.is_sleep_pending
    with pytest.raises(EngineSleepingError, match="asleep") as info:
        engine.validate_request([1, 2, 3])
    assert info.value.code == "sleeping"
    control.on_wake()
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=2))
    assert len(run_to_completion(engine)["a"]) == 2


def test_abort_in_flight_and_forget_prefixes_when_quiet():
    engine = make_engine()
    engine.add_request("done", list(range(12)), SamplingParams(max_tokens=2))
    run_to_completion(engine)
    engine.add_request("a", list(range(12)), SamplingParams(max_tokens=50))
    engine.add_request("b", list(range(40, 52)), SamplingParams(max_tokens=50))
    engine.step()
    control = engine.control
    with pytest.raises(RuntimeError, match="hold blocks"):
        control.forget_prefixes()
    assert sorted(control.abort_in_flight()) == ["a", "b"]
    assert not control.is_quiet()  # the abort outputs are still owed
    outs = engine.step()
    assert {o.finish_reason for o in outs} == {FinishReason.ABORT}
    assert control.is_quiet()
    control.on_weights_updated()
    assert control.num_prefix_resets == 1
    engine.add_request("c", list(range(12)), SamplingParams(max_tokens=2))
    assert run_to_completion(engine)["c"][0].num_cached_tokens == 0
