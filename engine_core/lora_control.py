"""The engine core's LoRA verbs: names in, commands out, load results back.

    API / LLM ──register / unregister / resolve──▶ LoRAControl ──LoRACommands──▶ worker
                                                        ▲                         │
                                                        └────LoRALoadResult───────┘

In one process (the offline ``LLM``) ``exchange`` hands the commands to the worker's
LoRA manager directly; the engine-core service sends them as messages instead. The
registry and the scheduling rules live in lora_registry.py and lora_admission.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from engine_core.lora_admission import LoRAAdmission
from engine_core.lora_registry import AdapterState, LoRAAdapter, LoRACommands, LoRALoadResult
from engine_core.request import Request


class LoRAExecutor(Protocol):
    """The worker's side, in process: runs commands, reports finished loads."""

    def apply_lora_commands(self, commands: LoRACommands) -> None: ...

    def poll_lora_results(self, timeout_s: float = 0.0) -> list[LoRALoadResult]: ...


@dataclass(slots=True)
class LoRAResultEffect:
    """What one load result changed: a registration finished (``registered`` set, with
    ``error`` when it was refused), or a reload failed and ``refused_req_ids`` (parked
    requests) must end with ``error``."""

    adapter: LoRAAdapter | None
    registered: bool = False
    error: str | None = None
    refused_req_ids: list[str] = field(default_factory=list)


@dataclass(slots=True)
class LoRAStats:
    """Adapters by what their requests are doing (vLLM's lora_requests_info)."""

    running: list[str]
    waiting: list[str]
    num_loaded: int
    num_loads: int
    num_evictions: int
    num_load_failures: int


class LoRAControl:
    """Registration, name resolution, worker commands and load results."""

    def __init__(self, admission: LoRAAdmission):
        self.admission = admission
        self.registry = admission.registry

    def lora_id_of(self, name: str | None) -> int:
        """0 for the base model (None), else the registered adapter's id (404 if none)."""
        return 0 if name is None else self.registry.resolve(name).lora_id

    def register(self, name: str, path: str, lora_id: int | None = None,
                 is_checked: bool = True) -> LoRAAdapter:
        """Add an adapter. ``is_checked`` False: the worker checks it first (a load,
        kept when the host cache has room); it is served once that result arrives."""
        adapter = self.registry.register(name, path, lora_id, is_checked=is_checked)
        if not is_checked:
            self.registry.load(adapter, keep=self.registry.make_room())
        return adapter

    def unregister(self, name: str) -> LoRAAdapter:
        """Unload by name; requests already using it finish."""
        return self.registry.unregister(name)

    def adapters(self) -> list[LoRAAdapter]:
        return self.registry.registered()

    def take_commands(self) -> LoRACommands:
        return self.registry.take_commands()

    def on_result(self, result: LoRALoadResult) -> LoRAResultEffect:
        """Apply one load result (see LoRAResultEffect)."""
        adapter = self.registry.by_id.get(result.lora_id)
        is_check = adapter is not None and not adapter.is_registered \
            and not adapter.is_unloaded
        self.registry.on_result(result)
        if adapter is None or is_check:
            return LoRAResultEffect(adapter, registered=is_check, error=result.error)
        refused = []
        if result.error is not None:
            refused = [r.req_id for r in self.admission.parked if r.lora_id == adapter.lora_id]
        return LoRAResultEffect(adapter, error=result.error, refused_req_ids=refused)

    def exchange(self, executor: LoRAExecutor, wait_s: float = 0.0) -> list[LoRAResultEffect]:
        """In process: send the pending commands, apply the finished loads (waiting up
        to ``wait_s`` for one)."""
        commands = self.take_commands()
        if commands:
            executor.apply_lora_commands(commands)
        return [self.on_result(r) for r in executor.poll_lora_results(wait_s)]

    @property
    def is_loading(self) -> bool:
        return any(a.state is AdapterState.LOADING for a in self.registry.by_id.values())

    def stats(self, running: list[Request], waiting: list[Request]) -> LoRAStats:
        """Adapter names of running and of waiting (queued or parked) requests."""
        r = self.registry
        queued = [q.lora_id for q in waiting if q.lora_id]
        return LoRAStats(
            running=self.admission.names(q.lora_id for q in running),
            waiting=self.admission.names(queued + [p.lora_id for p in self.admission.parked]),
            num_loaded=sum(a.state is AdapterState.LOADED for a in r.by_id.values()),
            num_loads=r.num_loads, num_evictions=r.num_evictions,
            num_load_failures=r.num_load_failures)

