"""Wire messages: every type round-trips; garbage is a ProtocolError, never a crash."""
import msgpack
import pytest

from engine_core.model_facts import ModelFacts
from engine_core.outputs import EngineCoreOutput, FinishReason, ModelRunnerOutput, TokenLogprobs
from engine_core.sampling_params import SamplingParams
from engine_core.scheduler_output import (BlockCopy, CachedRequestData, NewRequestData,
                                          SchedulerOutput)
from engine_core.structured_outputs import StructuredOutputReport
from engine_core.worker_sampling import WorkerSamplingParams
from services.protocol import (PROTOCOL_VERSION, AbortRequest, AddRequest, ExecuteStep,
                               Health, HealthSnapshot, OutputDelta, ProtocolError,
                               RequestRejected, Shutdown, StageNewRequests, StepResult,
                               WorkerReady, decode, encode)

PARAMS = SamplingParams(temperature=0.7, top_k=5, stop=["\n\n"], seed=3, max_tokens=9,
                        logprobs=2, min_tokens=1, stop_token_ids=[4, 9, 7])
WORKER_PARAMS = WorkerSamplingParams.from_params(PARAMS)
NEW = NewRequestData("r1", [1, 2, 3], 3, WORKER_PARAMS, [5, 6], 0)
CONSTRAINED = SamplingParams(n=2, structured_outputs={"json": {"type": "object", "properties": {
    "b": {"type": "integer"}, "a": {"enum": ["x", "y"]}}}, "strict": False})
LOGPROBS = TokenLogprobs(token_id=7, logprob=-0.25, rank=1, top_token_ids=[7, 8],
                         top_logprobs=[-0.25, -1.5])

MESSAGES = [
    AddRequest("r1", [1, 2, 3], PARAMS, client_id="api-0", arrival_time=12.5,
               cache_salt="tenant-a", traceparent="00-" + "a" * 32 + "-" + "b" * 16 + "-01"),
    AddRequest("r3", [4, 5], CONSTRAINED, client_id="api-1", arrival_time=1.0),
    AddRequest("r4", [4], SamplingParams(structured_outputs={"choice": ["a", "b"]}),
               client_id="api-1", arrival_time=1.0),
    StageNewRequests(3, [NewRequestData("0_r3", [4, 5], 2, WorkerSamplingParams.from_params(
        CONSTRAINED), [1], 0)]),
    StepResult(3, ModelRunnerOutput(["r4"], [[7]], [None], StructuredOutputReport(
        deferred_req_ids=["0_r3"], compile_seconds=[0.002], num_cache_hits=1))),
    AbortRequest(["r1", "0_r2"]),
    OutputDelta([EngineCoreOutput("r1", [7], [LOGPROBS], FinishReason.STOP, stop_reason=2,
                                  num_cached_tokens=16, parent_req_id="p", index=1),
                 EngineCoreOutput("r2", [])]),
    ExecuteStep(4, SchedulerOutput(
        scheduled_new_reqs=[NEW],
        scheduled_cached_reqs=[CachedRequestData("r0", [9], 31)],
        num_scheduled_tokens={"r1": 3, "r0": 1}, total_num_scheduled_tokens=4,
        finished_req_ids={"gone"}, blocks_to_copy=[BlockCopy(5, 8)],
        num_cached_tokens={"r1": 0}), num_staged_new_reqs=2),
    ExecuteStep(5, SchedulerOutput(  # speculative decoding: drafts, dropped blocks
        scheduled_cached_reqs=[CachedRequestData("r0", [9, 10], 31, num_dropped_blocks=1),
                               CachedRequestData("r1", [], 12)],
        num_scheduled_tokens={"r0": 5, "r1": 3}, total_num_scheduled_tokens=8,
        num_spec_tokens={"r0": 4, "r1": 2}, spec_token_ids={"r0": [3, 1, 4, 1]})),
    StageNewRequests(4, [NEW, NEW]),
    HealthSnapshot(True, {"num_running": 2.0, "num_referenced_blocks": 7.0}),
    StepResult(4, ModelRunnerOutput(["r1"], [[7]], [[LOGPROBS]])),
    StepResult(6, ModelRunnerOutput(["r0", "r1"], [[3, 1, 5], [8]], [None, None])),
    StepResult(5, ModelRunnerOutput(), error="worker failed"),
    Health(True, {"num_running": 3.0, "kv_cache_usage": 0.25}),
    RequestRejected("r9", "max_tokens must be at least 1", "max_tokens"),
    WorkerReady(ModelFacts(num_blocks=100, block_size=16, max_model_len=2048,
                           vocab_size=49152, eos_token_ids=[2], dtype="bfloat16",
                           device="cpu")),
    Shutdown("SIGTERM"),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(message):
    frame = encode(message)
    assert isinstance(frame, bytes)
    assert decode(frame) == message


def frame(body, type_="AbortRequest", v=PROTOCOL_VERSION):
    return msgpack.packb({"v": v, "type": type_, "body": body})


@pytest.mark.parametrize("raw", [
    b"\xc1garbage",  # not msgpack
    msgpack.packb([1, 2, 3]),  # not a map
    frame({"req_ids": ["a"]}, v=99),  # other version
    frame({"req_ids": ["a"]}, type_="Pickle"),  # unknown type
    frame({"req_ids": "a"}),  # wrong type
    frame({"req_ids": [1]}),  # wrong element type
    frame({"req_ids": ["a"], "extra": 1}),  # unknown field
    frame({}),  # missing field
    frame({"req_id": "r", "prompt_token_ids": [1], "client_id": "c", "arrival_time": 0,
           "sampling_params": {"temperature": -1.0}}, type_="AddRequest"),  # invalid params
    frame({"req_id": "r", "prompt_token_ids": [1, True], "client_id": "c",
           "arrival_time": 0, "sampling_params": {}}, type_="AddRequest"),  # a bool id
    frame({"req_id": "r", "prompt_token_ids": [1], "client_id": "c", "arrival_time": 0,
           "sampling_params": {"stop_token_ids": [1, -2]}}, type_="AddRequest"),
    msgpack.packb({"v": 1, "type": "Shutdown", "body": {"reason": "x"}, "more": 1}),
])
def test_bad_frames_are_protocol_errors(raw):
    with pytest.raises(ProtocolError):
        decode(raw)


def test_only_protocol_messages_encode():
    with pytest.raises(TypeError):
        encode(PARAMS)


def test_worker_params_carry_no_stop_strings_and_stop_ids_only_with_min_tokens():
    assert WORKER_PARAMS.stop_token_ids and set(WORKER_PARAMS.stop_token_ids) == {4, 7, 9}
    plain = WorkerSamplingParams.from_params(PARAMS.clone(min_tokens=0))
    assert plain.stop_token_ids == () and not hasattr(plain, "stop")
    huge = SamplingParams(stop=["x" * 100_000] * 16, stop_token_ids=range(40_000))
    assert len(encode(StageNewRequests(0, [NewRequestData(
        "r", [1], 1, WorkerSamplingParams.from_params(huge), [1], 0)]))) < 1000


def test_token_id_lists_decode_to_their_declared_containers():
    message = decode(encode(AddRequest("r", list(range(1000)), PARAMS, "c", 0.0)))
    assert message.prompt_token_ids == list(range(1000))
    assert message.sampling_params.stop_token_ids == frozenset({4, 7, 9})
    assert decode(encode(ExecuteStep(1, SchedulerOutput(
        scheduled_new_reqs=[NEW])))).scheduler_output.scheduled_new_reqs[0] \
        .sampling_params.stop_token_ids == WORKER_PARAMS.stop_token_ids


def test_a_malformed_grammar_in_a_frame_is_a_protocol_error():
    plain = msgpack.unpackb(encode(MESSAGES[1]))
    plain["body"]["sampling_params"]["structured_outputs"]["choice"] = []
    with pytest.raises(ProtocolError):
        decode(msgpack.packb(plain))
