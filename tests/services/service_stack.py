"""Start the worker and engine-core services on temporary unix sockets (test helper)."""
import asyncio

from config import load_config
from services.engine_core_service.service import EngineCoreService
from services.protocol import OutputDelta, RequestRejected
from services.transport import Endpoint, start_site
from services.worker_service.service import WorkerService


def tiny_config(tiny_llama_dir, default_model_path):
    return load_config(overrides={
        "model": str(tiny_llama_dir), "tokenizer": str(default_model_path),
        "dtype": "float32", "max_model_len": 256, "num_blocks": 128,
        "observability.log_level": "warning"}, use_env=False)


async def start_core_stack(config, tmp_path):
    """Worker + engine core; returns (worker, core, engine endpoint, runners, loop task)."""
    worker = WorkerService(config)
    worker_ep = Endpoint(unix_path=str(tmp_path / "worker.sock"))
    engine_ep = Endpoint(unix_path=str(tmp_path / "engine.sock"))
    runners = [await start_site(worker.app(), worker_ep)]
    core = EngineCoreService(config, worker_ep)
    await core.connect_worker()
    runners.append(await start_site(core.app(), engine_ep))
    task = asyncio.get_running_loop().create_task(core.run())
    return worker, core, engine_ep, runners, task


async def stop_core_stack(core, runners, loop_task, *closables) -> None:
    """Close ``closables`` (links, client sessions) first, then the engine core's loop,
    the core and every site of :func:`start_core_stack`."""
    for thing in closables:
        await thing.close()
    loop_task.cancel()
    await core.close()
    for runner in runners:
        await runner.cleanup()


async def collect_outputs(link, want: set[str]) -> tuple[dict, dict]:
    """Read an engine-core link until every id in ``want`` ended: tokens per sample id
    and each RequestRejected by request id (a rejection ends all of its samples)."""
    tokens, rejected, ended = {}, {}, set()
    async for message in link.messages():
        if isinstance(message, RequestRejected):
            rejected[message.req_id] = message
            ended |= {w for w in want
                      if w == message.req_id or w.endswith("_" + message.req_id)}
        elif isinstance(message, OutputDelta):
            for out in message.outputs:
                tokens.setdefault(out.req_id, []).extend(out.new_token_ids)
                if out.finished:
                    ended.add(out.req_id)
        if ended >= want:
            return tokens, rejected
    raise AssertionError("the engine core closed the link")
