"""Engine-core and worker services over real unix sockets, driven like an API process."""
import asyncio
import time

from engine_core.sampling_params import SamplingParams
from services.protocol import AbortRequest, AddRequest
from services.transport import connect
from tests.services.service_stack import collect_outputs, start_core_stack, tiny_config

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def test_requests_flow_through_both_services(tiny_llama_dir, default_model_path, tmp_path,
                                            monkeypatch):
    from folio import LLM
    from services.worker_service import service as worker_service
    monkeypatch.setattr(worker_service, "IDLE_TRIM_SECONDS", 0.3)
    config = tiny_config(tiny_llama_dir, default_model_path)
    prompts = {"a": [5, 6, 7, 8], "b": list(range(100, 140)), "c": [9] * 20}
    offline = LLM(config)
    expected = {k: offline.generate({"prompt_token_ids": p}, GREEDY,
                                    use_tqdm=False)[0].outputs[0].token_ids
                for k, p in prompts.items()}

    async def main():
        worker, service, engine_ep, runners, loop_task = await start_core_stack(config, tmp_path)
        try:
            link, session = await connect(engine_ep, "api-test")
            for req_id, prompt in prompts.items():
                await link.send(AddRequest(req_id, prompt, GREEDY, "api-0", time.time()))
            await link.send(AddRequest("bad", [1, 2], GREEDY.clone(max_tokens=10_000),
                                       "api-0", time.time()))
            tokens, rejected = await asyncio.wait_for(
                collect_outputs(link, set(prompts) | {"bad"}), 60)
            assert {k: r.param for k, r in rejected.items()} == {"bad": "max_tokens"}
            assert tokens == expected
            # an abort mid-flight frees everything
            await link.send(AddRequest("long", [3, 4, 5], GREEDY.clone(max_tokens=200),
                                       "api-0", time.time()))
            await link.send(AbortRequest(["long"]))
            await asyncio.wait_for(collect_outputs(link, {"long"}), 60)
            kv = service.engine.scheduler.kv_cache_manager
            assert kv.usage == 0.0 and not service.engine.has_unfinished_requests()
            # idle: the worker hands its freed heap back once, not after every step
            await asyncio.sleep(1.0)
            assert 1 <= worker.num_idle_trims < worker.num_steps
            await link.close()
            await session.close()
        finally:
            loop_task.cancel()
            await service.close()
            for r in runners:
                await r.cleanup()
    asyncio.run(main())
