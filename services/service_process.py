"""What `folio serve` keeps about each child process (services/launcher.py)."""
from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field

from services.transport import Endpoint

RESTART_WINDOW_S = 60.0  # services.api_restart_budget counts restarts in this window


class ServiceDied(RuntimeError):
    """A supervised service exited when it should not have."""


@dataclass(slots=True)
class ServiceProcess:
    """One child: its name, health endpoint, how to start it, and its process."""

    name: str
    health: Endpoint | None  # None: a tensor-parallel rank, healthy with rank 0
    module: str
    extra_args: tuple[str, ...] = ()
    pass_fds: tuple[int, ...] = ()
    process: asyncio.subprocess.Process | None = None
    replica: int | None = None  # data parallelism: the replica it belongs to

    @property
    def is_api(self) -> bool:
        return self.module == "services.api"


@dataclass(slots=True)
class RestartBudget:
    """At most ``limit`` restarts in any ``window_s`` seconds."""

    limit: int
    window_s: float = RESTART_WINDOW_S
    _times: deque = field(default_factory=deque)

    def take(self) -> bool:
        """Spend one restart now if the budget allows it."""
        now = time.monotonic()
        while self._times and now - self._times[0] > self.window_s:
            self._times.popleft()
        if len(self._times) >= self.limit:
            return False
        self._times.append(now)
        return True
