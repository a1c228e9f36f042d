"""Issue 14, item 1: no pair of valid requests can make a step frame the worker refuses.

Driven at the engine-core service directly (real worker, real sockets, no API process),
so what is proven is the engine side, whatever limits the API adds on top.
"""
import asyncio
import time

import pytest

from engine_core.sampling_params import SamplingParams
from engine_core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from engine_core.worker_sampling import WorkerSamplingParams
from services.engine_core_service.step_frames import (StepTooLarge, new_request_bytes_bound,
                                                      step_frames)
from services.protocol import AddRequest, ExecuteStep, StageNewRequests, decode, encode
from services.transport import connect
from tests.services.service_stack import (collect_outputs, start_core_stack,
                                          stop_core_stack, tiny_config)

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def samples(req_id: str, n: int) -> set[str]:
    return {req_id} if n == 1 else {f"{i}_{req_id}" for i in range(n)}


async def _serve(loop_task, link, want: set[str], timeout: float = 120.0):
    """``collect_outputs`` that fails at once if the engine core's loop dies meanwhile."""
    collect = asyncio.ensure_future(collect_outputs(link, want))
    done, _ = await asyncio.wait({collect, loop_task}, timeout=timeout,
                                 return_when=asyncio.FIRST_COMPLETED)
    if collect not in done:
        collect.cancel()
        assert not loop_task.done(), f"the engine core died: {loop_task.exception()!r}"
        raise AssertionError(f"no answer within {timeout}s")
    return collect.result()


def hold_inbox_until(core, num_messages: int) -> None:
    """Make the engine core's first inbox pass wait for ``num_messages`` adds, so that
    requests sent back to back are planned together whatever the socket's timing."""
    apply_inbox = core._apply_inbox

    async def gated():
        while len(core.inbox) < num_messages:
            await asyncio.sleep(0.01)
        core._apply_inbox = apply_inbox
        await apply_inbox()
    core._apply_inbox = gated


def _stack_test(tiny_llama_dir, default_model_path, tmp_path, body, **link_attrs):
    config = tiny_config(tiny_llama_dir, default_model_path)

    async def main():
        _, core, engine_ep, runners, loop_task = await start_core_stack(config, tmp_path)
        for name, value in link_attrs.items():  # of the engine core's worker link
            setattr(core.worker, name, value)
        link, session = await connect(engine_ep, "api-test")
        try:
            await body(core, link, loop_task)
        finally:
            await stop_core_stack(core, runners, loop_task, link, session)
    asyncio.run(main())


def test_two_n16_requests_with_huge_stop_strings_keep_the_engine_serving(
        tiny_llama_dir, default_model_path, tmp_path):
    """The crash of issue 14: two requests, n=16, 16 stop strings of ~262,000 characters.
    Before, one step frame carried every sample's stop strings (67 MB > 64 MiB) and the
    worker hung up. Now both are served and a plain request afterwards too."""
    stop = [chr(ord("a") + i) * 262_000 for i in range(16)]
    crash = SamplingParams(n=16, max_tokens=1, stop=stop, temperature=1.0)

    async def body(core, link, loop_task):
        hold_inbox_until(core, 2)
        for req_id in ("crash-a", "crash-b"):
            await link.send(AddRequest(req_id, [1, 2], crash, "api-0", time.time()))
        tokens, rejected = await _serve(loop_task, link,
                                        samples("crash-a", 16) | samples("crash-b", 16))
        assert not rejected
        assert len(tokens) == 32 and all(len(t) == 1 for t in tokens.values())
        await link.send(AddRequest("after", [5, 6, 7], GREEDY, "api-0", time.time()))
        tokens, rejected = await _serve(loop_task, link, {"after"})
        assert not rejected and len(tokens["after"]) == 8
        assert core.engine.scheduler.kv_cache_manager.usage == 0.0
    _stack_test(tiny_llama_dir, default_model_path, tmp_path, body)


def _new(req_id: str, num_tokens: int, num_stop_ids: int = 0) -> NewRequestData:
    params = WorkerSamplingParams(min_tokens=1, stop_token_ids=tuple(range(num_stop_ids)))
    return NewRequestData(req_id, list(range(num_tokens)), num_tokens, params, [1, 2], 0)


def test_a_step_that_fits_is_one_frame_encoded_once():
    step = ExecuteStep(3, SchedulerOutput(scheduled_new_reqs=[_new("a", 100)],
                                          num_scheduled_tokens={"a": 100}))
    assert step_frames(step, 1 << 20) == [encode(step)]


def test_an_oversized_step_is_staged_in_frames_under_the_limit_and_reassembles():
    limit = 200_000
    new = [_new(f"r{i}", 2000, 20_000) for i in range(12)]  # ~65 KB each, ~780 KB in all
    so = SchedulerOutput(scheduled_new_reqs=new,
                         scheduled_cached_reqs=[CachedRequestData("old", [7], 40)],
                         num_scheduled_tokens={**{n.req_id: 16 for n in new}, "old": 1},
                         total_num_scheduled_tokens=16 * 12 + 1, finished_req_ids={"gone"})
    step = ExecuteStep(9, so)
    assert len(encode(step)) > limit
    frames = step_frames(step, limit)
    assert len(frames) > 2 and all(len(f) <= limit for f in frames)
    *staged, last = [decode(f) for f in frames]
    assert all(isinstance(m, StageNewRequests) and m.step_id == 9 for m in staged)
    assert last.num_staged_new_reqs == 12 and last.scheduler_output.scheduled_new_reqs == []
    last.scheduler_output.scheduled_new_reqs = [n for m in staged for n in m.new_reqs]
    assert last.scheduler_output == so  # the worker sees the step the scheduler built


def test_one_request_larger_than_a_frame_is_an_error_not_a_lost_link():
    step = ExecuteStep(1, SchedulerOutput(scheduled_new_reqs=[_new("a", 50_000)]))
    with pytest.raises(StepTooLarge):
        step_frames(step, 100_000)


def test_the_add_time_bound_holds_for_every_sample_of_a_request():
    params = SamplingParams(n=16, min_tokens=1, stop_token_ids=range(5000))
    bound = new_request_bytes_bound("cmpl-" + "f" * 32, params, max_model_len=256,
                                    block_size=16)
    worst = NewRequestData("15_cmpl-" + "f" * 32, [49151] * 256, 200,
                           WorkerSamplingParams.from_params(params), list(range(16)), 255,
                           num_output_tokens=56, lora_id=2 ** 40)
    assert len(encode(StageNewRequests(2 ** 40, [worst]))) <= bound


def test_oversized_steps_are_split_and_give_the_same_tokens(
        tiny_llama_dir, default_model_path, tmp_path):
    """Ten requests whose worker data (40,000 banned ids each, with min_tokens) take
    ~1.2 MB under a 1 MB frame limit: the step is staged in several frames, and every
    request generates what the offline engine generates (so the worker got it all)."""
    from folio import LLM
    params = SamplingParams(temperature=0.0, max_tokens=6, min_tokens=3,
                            stop_token_ids=range(9000, 49000))
    prompts = {f"r{i}": [11 + i, 40 + i, 7] for i in range(10)}
    offline = LLM(tiny_config(tiny_llama_dir, default_model_path))
    expected = {k: offline.generate({"prompt_token_ids": p}, params,
                                    use_tqdm=False)[0].outputs[0].token_ids
                for k, p in prompts.items()}

    async def body(core, link, loop_task):
        hold_inbox_until(core, len(prompts))
        for req_id, prompt in prompts.items():
            await link.send(AddRequest(req_id, prompt, params, "api-0", time.time()))
        tokens, rejected = await _serve(loop_task, link, set(prompts))
        assert not rejected and tokens == expected
        assert core.worker.num_split_steps >= 1
    _stack_test(tiny_llama_dir, default_model_path, tmp_path, body,
                max_frame_bytes=1_000_000)


def test_a_request_that_could_never_reach_the_worker_is_refused_cleanly(
        tiny_llama_dir, default_model_path, tmp_path):
    big = SamplingParams(max_tokens=4, min_tokens=1, stop_token_ids=range(40_000))

    async def body(core, link, loop_task):
        await link.send(AddRequest("big", [1, 2], big, "api-0", time.time()))
        await link.send(AddRequest("after", [5, 6, 7], GREEDY, "api-0", time.time()))
        tokens, rejected = await _serve(loop_task, link, {"big", "after"})
        assert rejected["big"].param == "stop_token_ids"
        assert "too large" in rejected["big"].message and "big" not in tokens
        assert len(tokens["after"]) == 8
    _stack_test(tiny_llama_dir, default_model_path, tmp_path, body,
                max_frame_bytes=300_000)
