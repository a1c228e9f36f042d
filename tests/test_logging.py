"""observability/logging.py: log lines go to the stderr of the moment they are written."""
import io
import sys

from observability.logging import configure_logging, get_logger


def test_lines_follow_a_replaced_stderr(monkeypatch):
    configure_logging("info")
    first, second = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    get_logger("t").info("one")
    first.close()  # a test's capture ends; logging after it must not raise
    monkeypatch.setattr(sys, "stderr", second)
    get_logger("t").info("two")
    assert "two" in second.getvalue()
