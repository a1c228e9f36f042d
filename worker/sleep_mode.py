"""Sleep and wake for a ModelRunner: give memory back between generations, take it again.

    level 1  the KV pool is freed; on CUDA the weights move to host memory
    level 2  the KV pool and the weights are freed; wake reloads them from model.path

The engine core forgets every cached prefix before the worker sleeps (their KV is
gone) and sends no step until it wakes. Parameters keep their identity through sleep:
only their ``.data`` is replaced, and on wake it is rebuilt with the shape and strides
it had, so the layout the loader chose (K-major on the CPU, worker/models/linear.py)
comes back exactly. The pool comes back zero-filled, as at start-up, so generation
after wake is what it was before sleep. Freed host memory is handed back to the system
(``malloc_trim``), so the process's resident size drops, not only its heap's use.
"""
from __future__ import annotations

import ctypes
import gc
from dataclasses import dataclass

import torch

from observability.logging import get_logger
from worker.huge_pages import move_to_huge_pages
from worker.kv_cache import allocate_kv_cache
from worker.kv_pool import maybe_capture_cuda_graphs
from worker.loader import load_model
from worker.models import prepacked
from worker.models.linear import k_major

log = get_logger(__name__)


@dataclass(slots=True, frozen=True)
class _Layout:
    """How a dropped tensor was laid out, to rebuild it in place on wake."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


def release_host_memory() -> None:
    """Return freed heap pages to the system (glibc); a no-op elsewhere."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class SleepMode:
    """The runner's sleep state: ``level`` 0 (awake), 1 or 2."""

    def __init__(self, runner):
        self.runner = runner
        self.level = 0
        self._num_blocks = 0
        self._layouts: dict[str, _Layout] = {}
        self._had_head_copy = False

    @property
    def is_sleeping(self) -> bool:
        return self.level > 0

    def sleep(self, level: int) -> None:
        """Free the KV pool (level 1) and the weights too (level 2). The caller makes
        sure no request is live: per-request state is dropped with the pool."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        if self.is_sleeping:
            raise RuntimeError(f"the worker is already asleep (level {self.level})")
        r = self.runner
        self._num_blocks = r.kv_caches[0].shape[1]
        r.requests.clear()
        r.cuda_graphs = None  # they read the pool's and the weights' addresses
        r.kv_caches = []
        if r.draft_runner is not None:
            r.draft_runner.kv_caches = []
        if level == 2:
            self._drop_weights()
        elif r.device.type == "cuda":
            self._move_weights(torch.device("cpu"))
        self.level = level
        release_host_memory()
        if r.device.type == "cuda":
            torch.cuda.empty_cache()
        log.info("worker asleep", level=level)

    def wake_up(self) -> None:
        """Take the weights and the pool back; a no-op when awake."""
        if not self.is_sleeping:
            return
        r = self.runner
        if self.level == 2:
            self._reload_weights()
        elif r.device.type == "cuda":
            self._move_weights(r.device)
        r.kv_caches = allocate_kv_cache(r.kv_cache_spec(), self._num_blocks, r.device)
        if r.draft_runner is not None:
            r.draft_runner.allocate_kv_cache(self._num_blocks)
        maybe_capture_cuda_graphs(r)
        log.info("worker awake", level=self.level)
        self.level = 0

    def _move_weights(self, device: torch.device) -> None:
        model = self.runner.model
        for param in model.parameters():
            param.data = param.data.to(device)
        if model.head_weight is not None:
            model.head_weight = model.head_weight.to(device)

    def _drop_weights(self) -> None:
        model = self.runner.model
        self._layouts = {name: _Layout(tuple(p.shape), p.stride(), p.dtype)
                         for name, p in model.named_parameters()}
        for param in model.parameters():
            prepacked.drop(param)  # oneDNN copies: rebuilt from the reloaded weight on use
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)
        self._had_head_copy = model.head_weight is not None
        model.head_weight = None

    def _reload_weights(self) -> None:
        r = self.runner
        model = r.model
        for name, param in model.named_parameters():
            layout = self._layouts[name]
            param.data = torch.empty_strided(layout.shape, layout.stride, dtype=layout.dtype,
                                             device=r.device)
        loaded = load_model(r.model_config.path, r.dtype)
        model.load_weights(loaded.state_dict)  # copies keep the strides just rebuilt
        del loaded
        if self._had_head_copy:
            model.head_weight = k_major(model.embed_tokens.weight)
        if r.device.type == "cpu" and r.worker_config.huge_pages:
            move_to_huge_pages(model)  # back on 2 MB pages, as loaded at start-up
        release_host_memory()
