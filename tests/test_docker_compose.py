"""docker-compose.yml cannot run here (no Docker); what can be checked is: it parses,
it wires the three services and Jaeger as the README says, and every service command
and health check in it starts locally, from the repository root, with the very same
arguments (only environment overrides point it at a tiny model and a free port)."""
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import urllib.request

import pytest
import yaml

from observability.otlp_receiver import OTLPReceiver

REPO = Path(__file__).resolve().parents[1]
FOLIO_SERVICES = ("worker", "engine-core", "api")
# rank 1 first: it has no health check, and rank 0 is healthy only once it has joined
TP2_SERVICES = ("tp2-worker-rank1", "tp2-worker", "tp2-engine-core", "tp2-api")


@pytest.fixture(scope="module")
def compose():
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())


def test_compose_wires_three_services_and_jaeger(compose):
    services = {n: s for n, s in compose["services"].items() if not s.get("profiles")}
    assert set(services) == {*FOLIO_SERVICES, "jaeger"}
    for name in FOLIO_SERVICES:
        svc = services[name]
        assert "./config:/app/config:ro" in svc["volumes"]  # edit the YAML: live retune
        assert "folio-sockets:/run/folio" in svc["volumes"]
        assert svc["command"][:2] == ["python", "-m"]
        assert importlib.util.find_spec(svc["command"][2]) is not None
        assert (REPO / svc["command"][svc["command"].index("--config") + 1]).is_file()
    assert services["engine-core"]["depends_on"]["worker"]["condition"] == "service_healthy"
    assert services["api"]["depends_on"]["engine-core"]["condition"] == "service_healthy"
    assert "8000:8000" in services["api"]["ports"]
    # the engine core watches the read-only mounted YAML by polling (Docker Desktop)
    assert services["engine-core"]["environment"]["WATCHFILES_FORCE_POLLING"] == "true"
    jaeger = services["jaeger"]
    assert jaeger["image"].startswith("jaegertracing/")
    assert jaeger["environment"]["COLLECTOR_OTLP_ENABLED"] == "true"
    assert {"16686:16686", "4318:4318"} <= set(jaeger["ports"])
    docker_cfg = yaml.safe_load((REPO / "config/docker.yaml").read_text())
    assert docker_cfg["services"]["socket_dir"] == "/run/folio"
    assert docker_cfg["observability"]["otlp_endpoint"] == "http://jaeger:4318"
    assert (REPO / "Dockerfile").is_file()


def test_gpu_override_reserves_a_gpu_for_the_worker_on_a_cuda_torch_image(compose):
    gpu = yaml.safe_load((REPO / "docker-compose.gpu.yml").read_text())
    assert set(gpu["services"]) == set(FOLIO_SERVICES)  # overrides only, no new service
    images = {gpu["services"][name]["image"] for name in FOLIO_SERVICES}
    assert images == {"folio:cuda"} != {compose["services"]["worker"]["image"]}
    worker = gpu["services"]["worker"]
    assert worker["build"]["context"] == "."
    index = worker["build"]["args"]["TORCH_INDEX_URL"]
    assert index.startswith("https://download.pytorch.org/whl/cu")
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    for name in ("engine-core", "api"):  # only the worker holds the GPU
        assert "deploy" not in gpu["services"][name]
    # the Dockerfile takes the index as a build argument, CPU by default
    dockerfile = (REPO / "Dockerfile").read_text()
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in dockerfile
    assert "pip install torch==2.13.0 --index-url ${TORCH_INDEX_URL}" in dockerfile
    # the shared config picks the GPU when there is one
    docker_cfg = yaml.safe_load((REPO / "config/docker.yaml").read_text())
    assert docker_cfg["worker"]["device"] == "auto" and docker_cfg["model"]["dtype"] == "auto"
def test_profile_tp2_wires_two_worker_ranks_and_its_own_stack(compose):
    services = {n: s for n, s in compose["services"].items() if s.get("profiles") == ["tp2"]}
    assert set(services) == set(TP2_SERVICES)
    assert services["tp2-worker-rank1"]["command"][-2:] == ["--rank", "1"]
    assert services["tp2-engine-core"]["depends_on"]["tp2-worker"]["condition"] == \
        "service_healthy"
    assert "8001:8000" in services["tp2-api"]["ports"]
    from config.loader import load_config
    cfg = load_config(REPO / "config/docker-tp2.yaml", use_env=False)
    assert cfg.parallel.tensor_parallel_size == 2 and cfg.parallel.master_port
    assert cfg.parallel.master_addr == "tp2-worker"  # rank 0's container
    assert cfg.services.socket_dir != load_config(REPO / "config/docker.yaml",
                                                  use_env=False).services.socket_dir


def _local(argv):
    return [sys.executable if argv[0] == "python" else argv[0], *argv[1:]]


def _start_locally(compose, names, env, cwd=REPO) -> list:
    """Each service's command (with its compose environment), in order, each healthy
    (where it has a check) before the next starts; ``cwd`` stands for /app."""
    procs = []
    for name in names:
        svc = compose["services"][name]
        procs.append(subprocess.Popen(_local(svc["command"]), cwd=cwd,
                                      env={**env, **svc.get("environment", {})}))
        if "healthcheck" not in svc:
            continue
        check = _local(svc["healthcheck"]["test"][1:])
        deadline = time.monotonic() + 180
        while subprocess.run(check, cwd=cwd, env=env, capture_output=True).returncode:
            assert all(p.poll() is None for p in procs), f"a service exited before {name}"
            assert time.monotonic() < deadline, f"{name} never became healthy"
            time.sleep(0.5)
    return procs


def _complete(port: int) -> None:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", headers={"Content-Type":
                                                            "application/json"},
        data=b'{"prompt": "Hello", "max_tokens": 4}')
    with urllib.request.urlopen(request, timeout=60) as r:
        assert r.status == 200


def _stop(procs) -> list:
    for p in reversed(procs):
        p.send_signal(signal.SIGTERM)
        p.wait(30)
    return [p.returncode for p in procs]


def _tiny_env(tiny_llama_dir, default_model_path) -> tuple[dict, int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # a short path (a unix socket's path is at most 107 bytes); the callers remove it
    sockets = tempfile.mkdtemp(prefix="folio-compose-")
    return {**os.environ, "PYTHONPATH": str(REPO), "FOLIO_SERVICES__SOCKET_DIR": sockets,
            "FOLIO_SERVICES__API_HOST": "127.0.0.1", "FOLIO_SERVICES__API_PORT": str(port),
            "FOLIO_MODEL__PATH": str(tiny_llama_dir),
            "FOLIO_MODEL__TOKENIZER": str(default_model_path),
            "FOLIO_MODEL__DTYPE": "float32", "FOLIO_MODEL__MAX_MODEL_LEN": "256",
            "FOLIO_MEMORY__NUM_BLOCKS": "64",
            "FOLIO_OBSERVABILITY__LOG_LEVEL": "warning"}, port


def test_compose_commands_start_locally_with_the_same_arguments(compose, tiny_llama_dir,
                                                               default_model_path):
    receiver = OTLPReceiver()  # stands in for the jaeger container
    env, port = _tiny_env(tiny_llama_dir, default_model_path)
    env.update({"FOLIO_OBSERVABILITY__OTLP_ENDPOINT": receiver.url,
                "OTEL_BSP_SCHEDULE_DELAY": "200"})
    # /app in the containers: a copy of config/ (the "mount") edited below, the code
    # from the repository
    app = Path(tempfile.mkdtemp(prefix="folio-app-"))
    shutil.copytree(REPO / "config", app / "config")
    procs = []
    try:
        procs = _start_locally(compose, FOLIO_SERVICES, env, cwd=app)
        _complete(port)
        # the compose config traces: the spans reach the collector it names
        receiver.wait_for(lambda spans: {"folio-api", "folio-engine-core", "folio-worker"}
                          <= {s.service for s in spans})
        # live retune: the edited "mounted" file reaches the API container (the engine
        # core polls it, as compose's WATCHFILES_FORCE_POLLING says)
        path = app / "config" / "docker.yaml"
        path.write_text(path.read_text().replace("max_num_seqs: 128", "max_num_seqs: 3"))
        deadline = time.monotonic() + 60
        while _admin_config(port)["scheduler"]["max_num_seqs"] != 3:
            assert time.monotonic() < deadline, "the edit never reached the API"
            time.sleep(0.2)
    finally:
        statuses = _stop(procs)
        shutil.rmtree(env["FOLIO_SERVICES__SOCKET_DIR"], ignore_errors=True)
    receiver.close()
    shutil.rmtree(app, ignore_errors=True)
    assert statuses == [0, 0, 0]


def _admin_config(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/admin/config", timeout=10) as r:
        return json.loads(r.read())


@pytest.mark.slow
def test_profile_tp2_commands_start_locally_with_the_same_arguments(
        compose, tiny_llama_dir, default_model_path):
    env, port = _tiny_env(tiny_llama_dir, default_model_path)
    with socket.socket() as s:  # rank 0's rendezvous, on this host instead of tp2-worker
        s.bind(("127.0.0.1", 0))
        env.update({"FOLIO_PARALLEL__MASTER_ADDR": "127.0.0.1",
                    "FOLIO_PARALLEL__MASTER_PORT": str(s.getsockname()[1]),
                    "FOLIO_WORKER__NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"})
    procs = []
    try:
        procs = _start_locally(compose, TP2_SERVICES, env)
        _complete(port)
    finally:
        statuses = _stop(procs)
        shutil.rmtree(env["FOLIO_SERVICES__SOCKET_DIR"], ignore_errors=True)
    assert statuses == [0, 0, 0, 0]
