"""Two ranks on "two hosts": each in its own network namespace, joined by a veth pair,
rank 1 reaching rank 0 only through ``parallel.master_addr`` (10.213.0.1). They give the
greedy tokens of the unsplit model. Needs root and ``ip netns``; skipped otherwise."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from engine_core.sampling_params import SamplingParams

REPO = Path(__file__).resolve().parents[2]
NS = ("folio-tp-a", "folio-tp-b")
VETH = ("folio-veth-a", "folio-veth-b")
ADDR = ("10.213.0.1", "10.213.0.2")
PROMPTS = [[1, 450, 7483, 310, 3444], list(range(20, 57)), [9, 8, 7, 6, 5, 4]]


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True)


def _namespaces_unavailable() -> str | None:
    if shutil.which("ip") is None:
        return "the ip command is not installed"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    probe = _ip("netns", "add", "folio-tp-probe")
    if probe.returncode:
        return f"ip netns add failed: {probe.stderr.strip()}"
    _ip("netns", "del", "folio-tp-probe")
    return None


@pytest.fixture
def two_hosts():
    reason = _namespaces_unavailable()
    if reason:
        pytest.skip(f"no network namespaces here: {reason}")
    steps = [("netns", "add", NS[0]), ("netns", "add", NS[1]),
             ("link", "add", VETH[0], "type", "veth", "peer", "name", VETH[1])]
    for i in range(2):
        steps += [("link", "set", VETH[i], "netns", NS[i]),
                  ("-n", NS[i], "addr", "add", f"{ADDR[i]}/24", "dev", VETH[i]),
                  ("-n", NS[i], "link", "set", VETH[i], "up"),
                  ("-n", NS[i], "link", "set", "lo", "up")]
    try:
        for step in steps:
            done = _ip(*step)
            assert done.returncode == 0, f"ip {' '.join(step)}: {done.stderr}"
        yield
    finally:
        for ns in NS:
            _ip("netns", "del", ns)  # takes its end of the veth pair with it


@pytest.mark.slow
def test_two_ranks_in_two_namespaces_give_the_size_one_tokens(
        two_hosts, tmp_path, tiny_llama_dir, default_model_path, make_tiny_llm):
    expected = [o.outputs[0].token_ids for o in make_tiny_llm(num_threads=1).generate(
        [{"prompt_token_ids": p} for p in PROMPTS],
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)]
    config = tmp_path / "tp2.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"path": str(tiny_llama_dir), "tokenizer": str(default_model_path),
                  "dtype": "float32", "max_model_len": 512},
        "memory": {"num_blocks": 256}, "worker": {"num_threads": 1},
        "observability": {"log_level": "warning"},
        "parallel": {"tensor_parallel_size": 2, "master_addr": ADDR[0],
                     "master_port": 29531}}))
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(PROMPTS))

    def in_ns(i: int, *argv: str, **kw) -> subprocess.Popen:
        env = {**os.environ, "GLOO_SOCKET_IFNAME": VETH[i]}
        return subprocess.Popen(["ip", "netns", "exec", NS[i], sys.executable, *argv],
                                cwd=REPO, env=env, text=True, **kw)

    rank1 = in_ns(1, "-m", "services.worker_service", "--config", str(config), "--rank", "1",
                  stderr=subprocess.PIPE)
    rank0 = in_ns(0, str(REPO / "tests/worker/tp_rank0_script.py"), str(config),
                  str(prompts), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = rank0.communicate(timeout=600)
        assert rank0.returncode == 0, err[-3000:]
        assert rank1.wait(60) == 0, rank1.stderr.read()[-3000:]
    finally:
        for p in (rank0, rank1):
            if p.poll() is None:
                p.kill()
                p.wait()
    assert json.loads(out.strip().splitlines()[-1]) == expected
