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


@pytest.fixture(scope="module")
def compose():
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())


def test_compose_wires_three_services_and_jaeger(compose):
    services = compose["services"]
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


def _local(argv):
    return [sys.executable if argv[0] == "python" else argv[0], *argv[1:]]


def test_compose_commands_start_locally_with_the_same_arguments(compose, tiny_llama_dir,
                                                               default_model_path):
    receiver = OTLPReceiver()  # stands in for the jaeger container
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sockets = tempfile.mkdtemp(prefix="folio-compose-")
    # /app in the containers: a copy of config/ (the "mount") edited below, the code
    # from the repository
    app = Path(tempfile.mkdtemp(prefix="folio-app-"))
    shutil.copytree(REPO / "config", app / "config")
    env = {**os.environ, "PYTHONPATH": str(REPO), "FOLIO_SERVICES__SOCKET_DIR": sockets,
           "FOLIO_SERVICES__API_HOST": "127.0.0.1", "FOLIO_SERVICES__API_PORT": str(port),
           "FOLIO_MODEL__PATH": str(tiny_llama_dir),
           "FOLIO_MODEL__TOKENIZER": str(default_model_path),
           "FOLIO_MODEL__DTYPE": "float32", "FOLIO_MODEL__MAX_MODEL_LEN": "256",
           "FOLIO_MEMORY__NUM_BLOCKS": "64", "FOLIO_OBSERVABILITY__LOG_LEVEL": "warning",
           "FOLIO_OBSERVABILITY__OTLP_ENDPOINT": receiver.url, "OTEL_BSP_SCHEDULE_DELAY": "200"}
    procs = []
    try:
        for name in FOLIO_SERVICES:  # in depends_on order, each healthy before the next
            svc = compose["services"][name]
            procs.append(subprocess.Popen(_local(svc["command"]), cwd=app,
                                          env={**env, **svc.get("environment", {})}))
            check = _local(svc["healthcheck"]["test"][1:])
            deadline = time.monotonic() + 120
            while subprocess.run(check, cwd=app, env=env, capture_output=True).returncode:
                assert procs[-1].poll() is None, f"{name} exited {procs[-1].returncode}"
                assert time.monotonic() < deadline, f"{name} never became healthy"
                time.sleep(0.5)
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions", headers={"Content-Type":
                                                                "application/json"},
            data=b'{"prompt": "Hello", "max_tokens": 4}')
        with urllib.request.urlopen(request, timeout=60) as r:
            assert r.status == 200
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
        for p in reversed(procs):
            p.send_signal(signal.SIGTERM)
            p.wait(30)
    receiver.close()
    shutil.rmtree(app, ignore_errors=True)
    assert [p.returncode for p in procs] == [0, 0, 0]


def _admin_config(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/admin/config", timeout=10) as r:
        return json.loads(r.read())
