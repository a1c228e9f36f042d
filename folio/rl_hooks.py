"""The offline engine's hooks for RL and eval loops (vLLM's names): ``sleep``,
``wake_up``, ``is_sleeping``, ``update_weights``, ``reset_prefix_cache`` and
``collective_rpc``.

They run between ``generate`` calls on the same EngineCore and worker verbs the
services use (engine_core/model_control.py, worker/worker_control.py): the engine
core waits for (or aborts) live requests, the worker acts, and every cached prefix
is forgotten with the KV or the weights it was computed from.
"""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from engine_core.engine import EngineCore
from worker.worker_control import WorkerControl


class RLHooks:
    """Mixed into LLM, which sets ``engine``, ``worker_control`` and ``config``."""

    engine: EngineCore
    worker_control: WorkerControl

    def _drain(self, abort_in_flight: bool) -> None:
        """Step until no request is live (aborting them first when asked)."""
        control = self.engine.control
        if abort_in_flight:
            control.abort_in_flight()
        while not control.is_quiet():
            self.engine.step()

    def sleep(self, level: int = 1, abort_in_flight: bool = False) -> None:
        """Free the KV pool (level 1; on CUDA the weights go to host memory) or the
        weights too (level 2; ``wake_up`` reloads them from ``model.path``, so a level-2
        sleep forgets weight updates). ``generate`` raises EngineSleepingError until
        ``wake_up``. Needs ``worker.enable_sleep_mode``."""
        if not self.config.worker.enable_sleep_mode:
            raise RuntimeError("sleep mode is off: pass enable_sleep_mode=True "
                               "(worker.enable_sleep_mode)")
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        control = self.engine.control
        if control.is_sleeping:
            return
        self._drain(abort_in_flight)
        self.worker_control.sleep(level)
        control.on_sleep(level)

    def wake_up(self) -> None:
        """Take the weights and the KV pool back; generation is as before ``sleep``."""
        if self.engine.control.is_sleeping:
            self.worker_control.wake_up()
            self.engine.control.on_wake()

    def is_sleeping(self) -> bool:
        return self.engine.control.is_sleeping

    def update_weights(self, weights: str | Path | Mapping[str, torch.Tensor]) -> int:
        """Load new weights (Hugging Face names; a safetensors file or folder, or a state
        dict; any subset of the model's weights) between steps and forget every cached
        prefix. Names and shapes are checked first: WeightUpdateError naming the bad
        tensor leaves the model unchanged. Returns the number of tensors replaced."""
        self._drain(False)
        num = self.worker_control.update_weights(weights)
        self.engine.control.on_weights_updated()
        return num

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (after live requests end)."""
        self._drain(False)
        self.engine.control.forget_prefixes()

    def collective_rpc(self, method: str, args: tuple | list = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Call ``method`` of the worker extension (``worker.extension_cls``) on every
        worker (one here); one result per worker, as vLLM returns them."""
        return [self.worker_control.collective_rpc(method, args, kwargs)]
