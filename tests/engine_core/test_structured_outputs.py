"""Issue 17, engine side: structured-output parameters are checked for shape on
construction, travel to the worker as one hashable GrammarSpec, and a sample the worker
deferred (its grammar still compiling) computes its last token again and samples later."""
import json

import pytest

from engine_core.outputs import ModelRunnerOutput
from engine_core.sampling_params import InvalidRequestError, SamplingParams
from engine_core.structured_outputs import (GrammarSpec, StructuredOutputError,
                                            StructuredOutputReport, StructuredOutputsParams)
from engine_core.worker_sampling import WorkerSamplingParams
from tests.engine_core.fake_executor import FakeExecutor, reference_output
from tests.engine_core.factories import make_engine


@pytest.mark.parametrize("fields,field", [
    ({}, "json"),
    ({"regex": "a", "choice": ["x"]}, "choice"),
    ({"choice": []}, "choice"),
    ({"choice": "yes"}, "choice"),
    ({"choice": ["a", ""]}, "choice"),
    ({"choice": ["a", 1]}, "choice"),
    ({"regex": ""}, "regex"),
    ({"regex": 5}, "regex"),
    ({"grammar": "   "}, "grammar"),
    ({"json": "[1, 2]"}, "json"),
    ({"json": "{not json"}, "json"),
    ({"json": 5}, "json"),
    ({"json": {"maximum": float("nan")}}, "json"),
    ({"json_object": "yes"}, "json_object"),
    ({"regex": "a", "strict": "no"}, "strict"),
    ({"regex": "a" * (1 << 20 + 1)}, "regex"),
])
def test_malformed_fields_are_refused_naming_the_field(fields, field):
    with pytest.raises(StructuredOutputError) as e:
        StructuredOutputsParams(**fields)
    assert e.value.field == field
    with pytest.raises(InvalidRequestError) as e:  # through SamplingParams too
        SamplingParams(structured_outputs=fields)
    assert e.value.param == "structured_outputs"


def test_each_kind_becomes_one_spec_and_equal_schemas_share_it():
    schema = {"type": "object", "properties": {"b": {"type": "integer"},
                                               "a": {"type": "string"}}}
    spec = StructuredOutputsParams(json=schema).spec
    assert spec == StructuredOutputsParams(json=json.dumps(schema)).spec
    assert list(json.loads(spec.text)["properties"]) == ["b", "a"]  # the output's order
    assert hash(spec) == hash(StructuredOutputsParams(json=dict(schema)).spec)
    assert StructuredOutputsParams(json=schema, strict=False).spec.strict is False
    assert StructuredOutputsParams(json_object=True).spec == GrammarSpec(
        "json", '{"type": "object"}')
    assert StructuredOutputsParams(choice=["y", "n"]).spec == GrammarSpec("choice",
                                                                          '["y", "n"]')
    assert StructuredOutputsParams(regex=r"\d+").spec == GrammarSpec("regex", r"\d+")
    assert StructuredOutputsParams(grammar="root ::= \"a\"").kind == "grammar"
    assert StructuredOutputsParams(json_object=True).kind == "json_object"


def test_sampling_params_carry_the_spec_to_the_worker_and_refuse_min_tokens():
    params = SamplingParams(structured_outputs={"choice": ["a", "b"]}, n=2)
    assert params.clone(n=1).structured_outputs is params.structured_outputs
    worker = WorkerSamplingParams.from_params(params)
    assert worker.grammar == GrammarSpec("choice", '["a", "b"]')
    assert WorkerSamplingParams.from_params(SamplingParams()).grammar is None
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(structured_outputs={"regex": "a+"}, min_tokens=2)
    assert e.value.param == "min_tokens"
    with pytest.raises(InvalidRequestError):
        SamplingParams(structured_outputs="json")


class DeferringExecutor(FakeExecutor):
    """Defers ``req_id``'s first ``times`` samples, as a worker does while the
    request's grammar compiles: no token, the step's last token given back."""

    def __init__(self, block_size: int, req_id: str, times: int):
        super().__init__(block_size)
        self.req_id, self.times = req_id, times

    def _sample(self, so):
        state = self.states.get(self.req_id)
        defer = (self.times > 0 and self.req_id in so.num_scheduled_tokens
                 and state.num_computed_tokens == len(state.tokens))
        if defer:
            self.times -= 1
            state.num_computed_tokens -= 1  # the worker takes the engine's count next step
            tokens = state.tokens
            state.tokens = tokens + [None]  # skip sampling it this step
        out = super()._sample(so)
        if defer:
            state.tokens = tokens
            out.structured_output = StructuredOutputReport(deferred_req_ids=[self.req_id])
        return out


def test_a_deferred_sample_recomputes_its_last_token_while_others_go_on():
    engine = make_engine(max_num_batched_tokens=64)
    engine.executor = DeferringExecutor(4, "slow", times=3)
    engine.add_request("slow", list(range(10)), SamplingParams(max_tokens=5))
    engine.add_request("free", list(range(20, 27)), SamplingParams(max_tokens=5))
    got: dict[str, list[int]] = {"slow": [], "free": []}
    steps = {"slow": [], "free": []}
    for step in range(20):
        for out in engine.step():
            got[out.req_id] += out.new_token_ids
            if out.new_token_ids:
                steps[out.req_id].append(step)
        if not engine.has_unfinished_requests():
            break
    assert got["slow"] == reference_output(list(range(10)), 5)
    assert got["free"] == reference_output(list(range(20, 27)), 5)
    assert steps["free"][0] == 0 and steps["slow"][0] == 3  # deferred three steps
    recomputed = [so.num_scheduled_tokens.get("slow") for so in engine.executor.outputs[1:4]]
    assert recomputed == [1, 1, 1]
    assert engine.scheduler.kv_cache_manager.num_free_blocks == 64 - 1


def test_a_report_without_deferrals_changes_nothing():
    engine = make_engine()
    engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=2))
    so = engine.begin_step()
    mro = engine.executor.execute_model(so)
    mro.structured_output = StructuredOutputReport(compile_seconds=[0.001], num_cache_hits=2)
    outs = engine.end_step(so, mro)
    assert outs[0].new_token_ids == reference_output([1, 2, 3], 1)
    assert isinstance(ModelRunnerOutput().structured_output, type(None))
