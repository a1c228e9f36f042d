"""Fixtures for engine-core tests. The factories themselves live in factories.py so
that tests (and hypothesis strategies) can also import them directly."""
from __future__ import annotations

import pytest

from tests.engine_core import factories
from tests.engine_core.fake_executor import FakeExecutor


@pytest.fixture
def executor() -> FakeExecutor:
    """A fake runner for the default block size (4) of make_scheduler()."""
    return FakeExecutor(block_size=4)


@pytest.fixture
def request_factory():
    return factories.make_request


@pytest.fixture
def scheduler_factory():
    return factories.make_scheduler


@pytest.fixture
def engine_factory():
    return factories.make_engine
