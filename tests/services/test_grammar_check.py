"""The API's grammar check: its thread's priority and what its time limit counts."""
import asyncio
import os
import threading
import time

import pytest

from engine_core.structured_outputs import GrammarSpec
from services.api.grammar_check import GrammarChecker

pytestmark = pytest.mark.skipif(not hasattr(time, "pthread_getcpuclockid"),
                                reason="no per-thread CPU clock on this platform")


class SleepingCompiler:
    """Takes wall time but no CPU, as a compile starved by a busy machine does."""

    ll_tokenizer = None

    def __init__(self, seconds: float):
        self.seconds = seconds

    def compile(self, spec):
        time.sleep(self.seconds)


def test_the_limit_counts_the_compiles_cpu_seconds_not_a_busy_machines_wall(smollm_tokenizer):
    checker = GrammarChecker(smollm_tokenizer, 49152, [2], timeout_s=0.1)
    checker.compiler = SleepingCompiler(0.5)
    try:  # five times the limit in wall time, no CPU: not refused
        assert asyncio.run(checker.check(GrammarSpec("regex", "a+"), "guided_regex")) is False
    finally:
        checker.close()


def test_compiles_run_at_a_lower_priority(smollm_tokenizer):
    checker = GrammarChecker(smollm_tokenizer, 49152, [2], timeout_s=2.0)
    try:
        nice = checker._executor.submit(
            lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())).result()
    finally:
        checker.close()
    assert nice > os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) or nice == 19
