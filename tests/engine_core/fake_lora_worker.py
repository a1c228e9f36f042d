"""The worker's LoRA side for engine-core tests, and an executor that checks every step.

``FakeLoRAWorker`` keeps a host cache of adapter ids: loads wait in ``pending`` until
``finish`` (or at the next poll with ``is_instant``); ids in ``failing`` fail. The
``LoRACheckingExecutor`` fails a test when a step runs a request whose adapter the
cache lacks, holds more than ``max_loras`` adapters, or when the cache ever outgrows
``max_cpu_loras``.
"""
from __future__ import annotations

from config.lora import LoRAAdapterConfig, LoRAConfig
from config.schema import CacheConfig, SchedulerConfig
from engine_core.engine import EngineCore
from engine_core.lora_registry import LoRACommands, LoRALoad, LoRALoadResult
from tests.engine_core.fake_executor import FakeExecutor


class FakeLoRAWorker:
    """Implements engine_core.lora_control.LoRAExecutor over a set of cached ids."""

    def __init__(self, max_cpu_loras: int, is_instant: bool = True):
        self.max_cpu_loras = max_cpu_loras
        self.is_instant = is_instant
        self.cache: set[int] = set()
        self.pending: list[LoRALoad] = []
        self.failing: set[int] = set()
        self.loads: list[int] = []  # every finished load, in order
        self.evictions: list[int] = []
        self._done: list[LoRALoadResult] = []

    def apply_lora_commands(self, commands: LoRACommands) -> None:
        for lora_id in commands.evictions:
            assert lora_id in self.cache, f"evicting adapter {lora_id}, which is not cached"
            self.cache.discard(lora_id)
            self.evictions.append(lora_id)
        self.pending.extend(commands.loads)

    def finish(self) -> None:
        """Complete every pending load."""
        for load in self.pending:
            if load.lora_id in self.failing:
                self._done.append(LoRALoadResult(load.lora_id, "files are gone"))
                continue
            if load.keep:
                self.cache.add(load.lora_id)
                assert len(self.cache) <= self.max_cpu_loras, "host cache over max_cpu_loras"
            self.loads.append(load.lora_id)
            self._done.append(LoRALoadResult(load.lora_id))
        self.pending = []

    def poll_lora_results(self, timeout_s: float = 0.0) -> list[LoRALoadResult]:
        if self.is_instant:
            self.finish()
        done, self._done = self._done, []
        return done


class LoRACheckingExecutor(FakeExecutor):
    """FakeExecutor that checks each step against the fake worker's cache."""

    def __init__(self, block_size: int, worker: FakeLoRAWorker, max_loras: int):
        super().__init__(block_size)
        self.worker, self.max_loras = worker, max_loras
        self.step_loras: list[set[int]] = []  # adapters of each step, in order

    def execute_model(self, so):
        out = super().execute_model(so)
        used = {self.states[r].lora_id for r in so.num_scheduled_tokens} - {0}
        assert used <= self.worker.cache, f"step ran adapters {used - self.worker.cache} " \
                                          f"that the worker has not loaded"
        assert len(used) <= self.max_loras, f"{len(used)} adapters in one step"
        self.step_loras.append(used)
        return out


def make_lora_engine(num_adapters: int = 4, max_loras: int = 2, max_cpu_loras: int = 4,
                     is_instant: bool = True, max_num_seqs: int = 8,
                     max_num_batched_tokens: int = 32, policy: str = "fcfs") -> EngineCore:
    """An engine with adapters "a0".."a{n-1}" (ids 1..n) over the fake worker."""
    config = LoRAConfig(enable_lora=True, max_loras=max_loras, max_cpu_loras=max_cpu_loras,
                        adapters=tuple(LoRAAdapterConfig(f"a{i}", f"/adapters/a{i}")
                                       for i in range(num_adapters)))
    worker = FakeLoRAWorker(max_cpu_loras, is_instant)
    executor = LoRACheckingExecutor(4, worker, max_loras)
    return EngineCore(SchedulerConfig(max_num_seqs=max_num_seqs, policy=policy,
                                      max_num_batched_tokens=max_num_batched_tokens),
                      CacheConfig(), 256, 4, 128, executor, lora_config=config,
                      lora_executor=worker)
