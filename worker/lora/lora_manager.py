"""The worker's adapters: a host cache filled by a loader thread and emptied on the engine
core's word, the device slots, and each step's token → slot mapping.

The engine core decides what is loaded and evicted (engine_core/lora_registry.py); the
worker executes. Loads read and check the PEFT files on their own thread, off the step
loop; a finished adapter enters the cache before its result is reported, so a step
never sees an adapter the engine core believes loaded but the cache lacks. Evictions
run between steps (the worker service handles one message at a time).
"""
from __future__ import annotations

import queue
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from config.lora import LoRAConfig
from engine_core.lora_registry import LoRACommands, LoRALoad, LoRALoadResult
from kernels.lora_mapping import NO_SLOT, make_lora_mapping
from observability.logging import get_logger
from worker.lora.lora_slots import LoRASlots
from worker.lora.slot_dtype import lora_slot_dtype
from worker.lora.lora_step import LoRAStep
from worker.lora.peft_adapter import LoRAAdapterError, LoRAAdapterWeights, load_peft_adapter
from worker.models.architecture import ModelArchitecture

log = get_logger(__name__)


class LoRAManager:
    """Host cache + device slots of one worker (see the module docstring)."""

    def __init__(self, config: LoRAConfig, arch: ModelArchitecture, dtype: torch.dtype,
                 device: torch.device):
        self.config, self.arch, self.device = config, arch, device
        self.cache: dict[int, LoRAAdapterWeights] = {}
        slot_dtype = lora_slot_dtype(dtype, device)  # measured on the CPU
        self.slots = LoRASlots(arch, config.max_loras, config.max_lora_rank, slot_dtype,
                               device)
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="folio-lora")
        self._results: queue.SimpleQueue[LoRALoadResult] = queue.SimpleQueue()

    def read(self, path: str) -> LoRAAdapterWeights:
        """Read and check one adapter now (LoRAAdapterError naming the problem)."""
        return load_peft_adapter(path, self.arch, self.config.max_lora_rank)

    def check_declared(self) -> None:
        """Check every adapter the YAML declares, at start-up (ValueError naming it)."""
        for adapter in self.config.adapters:
            try:
                self.read(adapter.path)
            except LoRAAdapterError as e:
                raise ValueError(f"lora.adapters: adapter {adapter.name!r}: {e}") from None

    # ---- commands from the engine core --------------------------------------------

    def start_load(self, load: LoRALoad,
                   on_done: Callable[[LoRALoadResult], None]) -> None:
        """Load on the loader thread; ``on_done`` runs there once the cache holds it."""
        self._loader.submit(self._load, load, on_done)

    def _load(self, load: LoRALoad, on_done: Callable[[LoRALoadResult], None]) -> None:
        t0 = time.perf_counter()
        try:
            weights = self.read(load.path)
        except Exception as e:  # the engine core refuses the requests that wait for it
            message = str(e) if isinstance(e, LoRAAdapterError) else \
                f"cannot read the adapter ({type(e).__name__})"
            log.warning("lora adapter load failed", lora_name=load.name,
                        lora_id=load.lora_id, error=message)
            on_done(LoRALoadResult(load.lora_id, message))
            return
        if load.keep:
            self.cache[load.lora_id] = weights
        log.info("lora adapter loaded" if load.keep else "lora adapter checked",
                 lora_name=load.name, lora_id=load.lora_id, rank=weights.rank,
                 modules=sorted(weights.modules), num_bytes=weights.num_bytes,
                 seconds=round(time.perf_counter() - t0, 3))
        on_done(LoRALoadResult(load.lora_id))

    def evict(self, lora_id: int) -> None:
        """Drop an adapter from the cache and its slot (the engine core knows it idle)."""
        if self.cache.pop(lora_id, None) is not None:
            self.slots.release(lora_id)
            log.info("lora adapter evicted", lora_id=lora_id, num_cached=len(self.cache))

    # ---- the in-process engine's executor (engine_core.lora_registry.LoRAExecutor) --

    def apply_lora_commands(self, commands: LoRACommands) -> None:
        for lora_id in commands.evictions:
            self.evict(lora_id)
        for load in commands.loads:
            self.start_load(load, self._results.put)

    def poll_lora_results(self, timeout_s: float = 0.0) -> list[LoRALoadResult]:
        """Finished loads; waits up to ``timeout_s`` for the first one."""
        results = []
        try:
            results.append(self._results.get(timeout=timeout_s) if timeout_s > 0
                           else self._results.get_nowait())
            while True:
                results.append(self._results.get_nowait())
        except queue.Empty:
            return results

    # ---- steps ---------------------------------------------------------------------

    def prepare_step(self, lora_ids: list[int], query_start_loc: list[int]) -> LoRAStep | None:
        """The step's LoRA work (request i of the batch uses adapter ``lora_ids[i]``,
        0: none); None when no request of the step uses an adapter."""
        wanted = set(lora_ids) - {0}
        if not wanted:
            return None
        missing = wanted - self.cache.keys()
        if missing:
            raise RuntimeError(f"adapters {sorted(missing)} were scheduled but are not "
                               f"loaded in the worker")
        placed = self.slots.activate(wanted, self.cache)
        slots = [placed[i] if i else NO_SLOT for i in lora_ids]
        mapping = make_lora_mapping(slots, query_start_loc, self.device)
        targets = frozenset().union(*(self.slots.slot_targets[s] for s in placed.values()))
        return LoRAStep(mapping, self.slots, targets)

    def close(self) -> None:
        self._loader.shutdown(wait=False, cancel_futures=True)
