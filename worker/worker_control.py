"""The worker's control verbs, run between steps: sleep and wake, weight updates and
``collective_rpc`` on the declared extension.

The offline ``LLM`` calls them directly; the worker service runs them for a
WorkerControlOp from the engine core (services/protocol.py) on its one torch thread,
so they never overlap a step. The engine core decides when they may run (no request
live for sleep and weight updates) and resets its prefix cache with them
(engine_core/model_control.py).
"""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from config.schema import WorkerConfig
from observability.logging import get_logger
from worker.sleep_mode import SleepMode
from worker.weight_update import (WeightUpdateError, apply_weight_update, plan_weight_update,
                                  read_update_weights)
from worker.worker_extension import RPCRefused, WorkerExtension

log = get_logger(__name__)


class WorkerControl:
    """Sleep state, weight updates and the extension of one ModelRunner."""

    def __init__(self, runner, worker_config: WorkerConfig):
        self.runner = runner
        self.sleep_mode = SleepMode(runner)
        self.extension = (WorkerExtension(worker_config.extension_cls, runner)
                          if worker_config.extension_cls else None)
        self.num_weight_updates = 0

    @property
    def is_sleeping(self) -> bool:
        return self.sleep_mode.is_sleeping

    def sleep(self, level: int) -> None:
        quantization = self.runner.quantization
        if level == 2 and quantization != "none":
            raise ValueError(f"sleep level 2 reloads float weights, and this model's are "
                             f"held quantized (model.quantization: {quantization}); use "
                             f"level 1, or model.quantization: none")
        if level == 2 and self.num_weight_updates:
            log.warning("sleep level 2 drops the updated weights: wake reloads model.path "
                        "(send the update again after waking)",
                        num_weight_updates=self.num_weight_updates)
        self.sleep_mode.sleep(level)

    def wake_up(self) -> None:
        self.sleep_mode.wake_up()

    def update_weights(self, source: str | Path | Mapping[str, torch.Tensor]) -> int:
        """Replace the weights ``source`` holds (all checked first; WeightUpdateError
        naming the bad tensor leaves the model as it was); returns how many."""
        if self.sleep_mode.level == 2:
            raise WeightUpdateError("the weights are dropped (sleep level 2): wake up first")
        quantization = self.runner.quantization
        if quantization != "none":
            raise WeightUpdateError(f"this model's weights are held quantized "
                                    f"(model.quantization: {quantization}); updates need "
                                    f"model.quantization: none")
        plan = plan_weight_update(read_update_weights(source), self.runner.arch,
                                  self.runner.model)
        apply_weight_update(self.runner.model, plan)
        self.num_weight_updates += 1
        log.info("weights updated", num_tensors=len(plan),
                 source=None if isinstance(source, Mapping) else str(source))
        return len(plan)

    def collective_rpc(self, method: str, args: tuple | list = (),
                       kwargs: dict[str, Any] | None = None) -> Any:
        """Call ``method`` of the declared extension (RPCRefused if not allowed)."""
        if self.extension is None:
            raise RPCRefused("no worker extension is declared (worker.extension_cls)")
        return self.extension.call(method, args, kwargs)
