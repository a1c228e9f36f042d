"""Fixtures shared by the service tests."""
import pytest

from tests.services.serve_process import ServeProcess, write_config


@pytest.fixture
def start_stack(tiny_llama_dir, default_model_path, tmp_path):
    started = []

    def start(**sections) -> ServeProcess:
        config = write_config(tmp_path / "folio.yaml", str(tiny_llama_dir),
                              str(default_model_path), **sections)
        serve = ServeProcess(config, tmp_path)
        started.append(serve)
        serve.wait_ready()
        return serve

    yield start
    for serve in started:  # never leave a stack behind, whatever the test did
        if serve.proc.poll() is None:
            serve.stop()
