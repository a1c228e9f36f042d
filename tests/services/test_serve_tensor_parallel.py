"""`folio serve` with parallel.tensor_parallel_size 2 on the tiny Llama (gloo on the
CPU): the openai client gets the same greedy text as the offline LLM at size 1,
streaming and not; killing rank 1 mid-stream ends every stream with an error event and
stops the stack non-zero, naming the rank, with no process left."""
import asyncio
import os
import signal

import aiohttp
import openai
import pytest

from observability.process_stats import command_line
from tests.services.serve_process import ServeProcess, processes_using, write_config
from tests.services.test_serve_e2e import MODEL
from tests.services.test_serve_lifecycle import (assert_engine_lost, assert_nothing_left,
                                                 open_streams)

pytestmark = pytest.mark.slow
TP2 = dict(parallel={"tensor_parallel_size": 2}, worker={"num_threads": 1},
           services={"startup_timeout_s": 300, "drain_timeout_s": 20})
PROMPTS = ["The capital of France", "def fibonacci(n):", "Once upon a time"]


def rank_pid(serve: ServeProcess, rank: int) -> int:
    for pid in serve.child_pids:
        args = command_line(pid)
        if "services.worker_service" in args and "--rank" in args \
                and args[args.index("--rank") + 1] == str(rank):
            return pid
    raise LookupError(f"rank {rank}")


@pytest.fixture(scope="module")
def size_one_texts(tiny_llama_dir, default_model_path):
    from engine_core.sampling_params import SamplingParams
    from folio import LLM
    llm = LLM(model=str(tiny_llama_dir), tokenizer=str(default_model_path), dtype="float32",
              max_model_len=1024, num_blocks=512, **{"observability.log_level": "warning"})
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                        use_tqdm=False)
    return [o.outputs[0].text for o in outs]


def test_tp2_serves_the_size_one_tokens_streaming_and_not(start_stack, size_one_texts):
    serve = start_stack(**TP2)
    assert rank_pid(serve, 1)  # rank 1 runs as its own supervised process

    async def main():
        client = openai.AsyncOpenAI(base_url=serve.url + "/v1", api_key="none",
                                    max_retries=0)
        whole = await asyncio.gather(*(client.completions.create(
            model=MODEL, prompt=p, max_tokens=24, temperature=0,
            extra_body={"ignore_eos": True}) for p in PROMPTS))
        streamed = []
        for p in PROMPTS:
            chunks = await client.completions.create(
                model=MODEL, prompt=p, max_tokens=24, temperature=0, stream=True,
                extra_body={"ignore_eos": True})
            streamed.append("".join([c.choices[0].text async for c in chunks]))
        await client.close()
        return [r.choices[0].text for r in whole], streamed

    whole, streamed = asyncio.run(main())
    assert whole == size_one_texts
    assert streamed == size_one_texts
    assert serve.stop() == 0, serve.output()[-3000:]
    assert_nothing_left(serve)


def test_killing_rank_1_mid_stream_stops_the_stack_naming_it(start_stack):
    serve = start_stack(**TP2)
    stream = {"model": MODEL, "prompt": "Count with me", "max_tokens": 900,
              "ignore_eos": True, "stream": True}

    async def main():
        async with aiohttp.ClientSession() as s:
            streams = await open_streams(s, serve, stream, n=4)
            os.kill(rank_pid(serve, 1), signal.SIGKILL)
            await assert_engine_lost(s, serve, streams)

    asyncio.run(main())
    assert serve.wait(timeout=30) != 0
    assert "worker-rank-1 died" in serve.output()
    assert_nothing_left(serve)


def test_a_size_that_does_not_split_the_heads_fails_start_up_naming_the_sizes_that_do(
        tmp_path, tiny_llama_dir, default_model_path):
    config = write_config(tmp_path / "tp3.yaml", str(tiny_llama_dir), str(default_model_path),
                          parallel={"tensor_parallel_size": 3}, worker={"num_threads": 1})
    serve = ServeProcess(config, tmp_path)
    assert serve.wait(timeout=300) == 1
    out = serve.output()
    assert ("parallel.tensor_parallel_size=3 cannot split this model: it must divide the 4 "
            "attention heads") in out, out[-3000:]
    assert "(sizes that work: 1, 2, 4)" in out
    assert "start-up failed" in out
    assert not processes_using(config)
