"""Sleep on the real default model, measured where it counts: the worker process's
resident size (VmRSS in /proc/<pid>/status). Level 1 must give back at least the KV
pool, level 2 the pool and the weights (the tied head's K-major copy included); after
each wake greedy answers are what they were."""
import asyncio
import re
from pathlib import Path

import aiohttp
import pytest

from tests.services.serve_process import running, write_config

HEAP_SLACK = 2 * 2 ** 20
RSS_SLACK = 0.02  # of the bytes freed: resident pages the kernel already let go
KV_CACHE_BYTES = 256 * 1024 ** 2
PROMPTS = ["The three primary colours are", "def add(a, b):\n"]

pytestmark = pytest.mark.slow


def vm_rss(pid: int) -> int:
    """Resident bytes of ``pid`` now."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^VmRSS:\s+(\d+) kB", status, re.M).group(1)) * 1024


async def post(http, url, route, body=None):
    async with http.post(url + route, json=body) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def answers(http, url):
    out = []
    for prompt in PROMPTS:
        body = await post(http, url, "/v1/completions", {
            "prompt": prompt, "max_tokens": 24, "temperature": 0.0})
        out.append(body["choices"][0]["text"])
    return out


def test_sleep_gives_back_the_kv_pool_and_the_weights(tmp_path):
    config = write_config(
        tmp_path / "folio.yaml", "default", None,
        model={"served_model_name": None, "max_model_len": 1024},
        memory={"num_blocks": None, "kv_cache_bytes": KV_CACHE_BYTES},
        services={"startup_timeout_s": 600},
        worker={"enable_sleep_mode": True,
                "extension_cls": "tests.rl_extension:ChecksumExtension"})
    with running(config, tmp_path) as serve:
        pid = serve.pid_of("services.worker_service")

        async def main():
            async with aiohttp.ClientSession() as http:
                url = serve.url
                before = await answers(http, url)
                sizes = (await post(http, url, "/collective_rpc",
                                    {"method": "memory_bytes"}))["results"][0]
                measured = {"kv_cache_bytes": sizes["kv_cache"],
                            "weight_bytes": sizes["weights"]}
                for level in (1, 2):
                    awake = vm_rss(pid)
                    await post(http, url, f"/sleep?level={level}")
                    asleep = vm_rss(pid)
                    await post(http, url, "/wake_up")
                    measured[f"level{level}"] = (awake, asleep, vm_rss(pid))
                    assert await answers(http, url) == before
                return measured

        m = asyncio.run(main())
    print("\nworker VmRSS (awake, asleep, woken) in MiB:",
          {k: tuple(round(v / 2 ** 20, 1) for v in val) if isinstance(val, tuple)
           else round(val / 2 ** 20, 1) for k, val in m.items()})
    assert m["kv_cache_bytes"] >= KV_CACHE_BYTES * 0.99  # the pool is whole blocks
    # VmRSS also moves with the interpreter's own heap while the sleep request is
    # handled, and counts only resident pages: alone, the level-2 drop exceeded the
    # freed tensors by 0.2-2 MiB; in a full suite run on a busy 2-core machine it fell
    # 6.5 MiB (0.7%) short. The freed tensors must show up less HEAP_SLACK and RSS_SLACK.
    def freed_enough(drop: int, freed: int) -> bool:
        return drop >= freed * (1 - RSS_SLACK) - HEAP_SLACK
    awake, asleep, _ = m["level1"]
    assert freed_enough(awake - asleep, m["kv_cache_bytes"])
    awake, asleep, _ = m["level2"]
    assert freed_enough(awake - asleep, m["kv_cache_bytes"] + m["weight_bytes"])
