"""`folio serve` with parallel.data_parallel_size 2 on the tiny Llama (float32):

- a shared-prefix workload (8 prefixes of 1,000 tokens, 64 requests) computes at least
  1.8x fewer prompt tokens with routing prefix_aware than round_robin, read from
  /metrics (the replicas' sum), with identical greedy outputs;
- /health and /metrics show the whole and each replica; reset_prefix_cache reaches both;
- killing one replica's engine core moves new requests to the other without a 5xx,
  /health reports the dead replica, and the stack keeps serving until it is stopped.
"""
import asyncio
import os
import re
import signal
import time

import aiohttp
import pytest

from benchmarks.dp_routing import NUM_PREFIXES, PREFIX_LEN, SUFFIX_LEN, workload
from observability.process_stats import command_line
from tests.services.serve_process import ServeProcess
from tests.services.test_serve_e2e import MODEL
from tests.services.test_serve_lifecycle import assert_nothing_left

pytestmark = pytest.mark.slow


def dp2(routing: str) -> dict:
    return dict(parallel={"data_parallel_size": 2, "routing": routing},
                worker={"num_threads": 1}, memory={"num_blocks": 1024},
                services={"startup_timeout_s": 300, "drain_timeout_s": 20})


async def metrics(session, url: str) -> dict[str, float]:
    async with session.get(url + "/metrics") as r:
        assert r.status == 200, await r.text()
        text = await r.text()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}


def total(m: dict[str, float], name: str, replica: str = "all") -> float:
    pattern = re.compile(rf'^folio:{name}\{{.*replica="{replica}".*\}}$')
    return sum(v for k, v in m.items() if pattern.match(k))


async def complete(session, url: str, prompt: list[int]) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0,
            "ignore_eos": True}
    async with session.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        choice = (await r.json())["choices"][0]
    return choice["text"]


async def run_workload(url: str) -> tuple[list, float, dict]:
    """Outputs, prompt tokens computed (prompt tokens less prefix-cache hits, summed
    over the replicas) and the final metrics."""
    prompts = workload()
    async with aiohttp.ClientSession() as s:
        # the API serves once one replica is up; the workload is for both (on a busy
        # machine replica 1 came up late, every prefix went to replica 0 and the
        # imbalance cap then recomputed some on replica 1)
        deadline = time.monotonic() + 300
        while (await health(s, url))[1].get("engine", {}).get("num_replicas_serving") != 2:
            assert time.monotonic() < deadline, "replica 1 never came up"
            await asyncio.sleep(0.2)
        first = [await complete(s, url, p) for p in prompts[:NUM_PREFIXES]]
        rest = await asyncio.gather(*(complete(s, url, p) for p in prompts[NUM_PREFIXES:]))
        m = await metrics(s, url)
    computed = total(m, "prompt_tokens_total") - total(m, "prefix_cache_hits_total")
    return first + list(rest), computed, m


def test_prefix_aware_routing_computes_fewer_prompt_tokens(start_stack):
    results = {}
    for routing in ("prefix_aware", "round_robin"):
        serve = start_stack(**dp2(routing))
        results[routing] = asyncio.run(run_workload(serve.url))
        assert serve.stop() == 0, serve.output()[-3000:]
    (aware_out, aware, m), (rr_out, rr, _) = results["prefix_aware"], results["round_robin"]
    assert total(m, "prompt_tokens_total") == len(workload()) * (PREFIX_LEN + SUFFIX_LEN)
    for r in ("0", "1"):  # each replica is shown alone too, and both took requests
        assert total(m, "prompt_tokens_total", r) > 0
        assert m[f'folio:replica_up{{replica="{r}"}}'] == 1.0
    print(f"prompt tokens computed: prefix_aware {aware:.0f}, round_robin {rr:.0f}")
    assert aware_out == rr_out  # greedy: the route never changes the tokens
    assert rr / aware >= 1.8, (rr, aware)


def replica_pid(serve: ServeProcess, module: str, replica: int) -> int:
    for pid in serve.child_pids:
        args = command_line(pid)
        if module in args and "--replica" in args \
                and args[args.index("--replica") + 1] == str(replica):
            return pid
    raise LookupError(f"{module} replica {replica}")


async def health(session, url: str) -> tuple[int, dict]:
    async with session.get(url + "/health") as r:
        return r.status, await r.json()


def test_control_fans_out_and_a_dead_replica_is_routed_around(start_stack):
    serve = start_stack(**dp2("prefix_aware"))
    prompts = workload()[:16]

    async def main():
        async with aiohttp.ClientSession() as s:
            async with s.post(serve.url + "/reset_prefix_cache") as r:
                assert r.status == 200, await r.text()
            status, body = await health(s, serve.url)
            assert status == 200 and [x["status"] for x in body["replicas"]] == ["ok", "ok"]
            # the replica's snapshot may lag its reply by one publish interval
            deadline = time.monotonic() + 5
            while not all(x["engine"].get("num_prefix_cache_resets") == 1
                          for x in body["replicas"]):
                assert time.monotonic() < deadline, body
                await asyncio.sleep(0.1)
                body = (await health(s, serve.url))[1]
            assert body["engine"]["num_replicas_serving"] == 2
            await asyncio.gather(*(complete(s, serve.url, p) for p in prompts))

            os.kill(replica_pid(serve, "services.engine_core_service", 1), signal.SIGKILL)
            await asyncio.gather(*(complete(s, serve.url, p) for p in prompts))  # no 5xx
            status, body = await health(s, serve.url)
            assert status == 200
            assert [x["status"] for x in body["replicas"]] == ["ok", "dead"]
            assert body["engine"]["num_replicas_serving"] == 1
            m = await metrics(s, serve.url)
            assert m['folio:replica_up{replica="1"}'] == 0.0
            assert total(m, "request_success_total", "0") >= len(prompts)

    asyncio.run(main())
    deadline = time.monotonic() + 30  # the supervisor stops replica 1's worker too
    while "replica 1 is down" not in serve.output():
        assert time.monotonic() < deadline, serve.output()[-3000:]
        time.sleep(0.2)
    assert serve.proc.poll() is None  # still serving on replica 0
    assert serve.stop() == 0, serve.output()[-3000:]
    assert_nothing_left(serve)
