"""The engine core's step loop: a step's outputs are routed while the next step runs (or
before the loop sleeps), and a request that arrives while they are being delivered is
never slept through.

Driven at the engine-core service directly (real worker on the tiny model, real sockets).
"""
import asyncio
import time

from engine_core.sampling_params import SamplingParams
from services.protocol import AddRequest
from services.transport import connect
from tests.services.service_stack import (collect_outputs, start_core_stack,
                                          stop_core_stack, tiny_config)

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def test_an_add_during_the_last_delivery_is_served(tiny_llama_dir, default_model_path,
                                                   tmp_path):
    """The first request's last outputs go out just before the loop would sleep; a second
    request arrives while they do. The loop must see it (its wake-up must not be cleared
    unseen), so the second request is served and the loop is not left asleep."""
    config = tiny_config(tiny_llama_dir, default_model_path)

    async def main():
        _, core, engine_ep, runners, loop_task = await start_core_stack(config, tmp_path)
        link, session = await connect(engine_ep, "api-test")
        deliver = core._deliver
        added = asyncio.Event()

        async def deliver_while_an_add_arrives(outputs):
            if any(o.finished for o in outputs) and not added.is_set():
                added.set()
                await link.send(AddRequest("second", [5, 6, 7], GREEDY, "api-0",
                                           time.time()))
                await asyncio.sleep(0.2)  # the add lands in the inbox meanwhile
            return await deliver(outputs)
        core._deliver = deliver_while_an_add_arrives
        try:
            await link.send(AddRequest("first", [1, 2, 3], GREEDY, "api-0", time.time()))
            tokens, rejected = await asyncio.wait_for(
                collect_outputs(link, {"first", "second"}), 30)
            assert added.is_set() and not rejected
            assert len(tokens["first"]) == 8 and len(tokens["second"]) == 8
            assert not loop_task.done()
        finally:
            await stop_core_stack(core, runners, loop_task, link, session)
    asyncio.run(main())
