"""LoRA in the scheduler: which requests may start, which adapters load, evict or drain.

Three rules, each with its reason:

* Parked until loaded. A request whose adapter is not in the worker's host cache waits
  outside the waiting queue (``WAITING_FOR_LORA``) while its adapter loads off the
  step loop; other requests go on. Loads start in the order their first request
  arrived. Invariant: every queued request's adapter is loaded (a loaded adapter with
  an unparked request is in use, and in-use adapters are never evicted).
* Drain one when the cache is full. If the oldest waiting load finds every cached
  adapter in use, the least recently used one drains: its new requests park (they
  will reload it in their turn) while its queued and running ones finish; then it is
  evicted and the load goes ahead. Without this, a busy adapter would keep the cache
  forever and a new one would never load.
* At most ``max_loras`` adapters per step. A queued request whose adapter is neither
  running nor fits among them is refused, and no other adapter request is admitted for
  the rest of the step: running adapters then drain and the refused request gets the
  first free slot. Under fcfs and priority the refused head stops admission anyway;
  under fair the other tenants would otherwise keep the slot busy for ever (the fair
  queue keeps the refused tenant's turn, so it is asked first the next step). Requests
  of the base model are never held back by LoRA (under fcfs and priority they wait
  behind a refused head, as behind any head that cannot start).
"""
from __future__ import annotations

from config.lora import LoRAConfig
from engine_core.lora_registry import AdapterState, LoRAAdapter, LoRARegistry
from engine_core.request import Request, RequestStatus


class LoRAAdmission:
    """The scheduler's LoRA rules (see the module docstring) over one registry."""

    def __init__(self, config: LoRAConfig):
        self.max_loras = config.max_loras
        self.registry = LoRARegistry(config.max_cpu_loras)
        for adapter in config.adapters:  # the worker checked them at start-up
            self.registry.register(adapter.name, adapter.path)
        self.parked: list[Request] = []  # in arrival order
        self.draining: LoRAAdapter | None = None
        self.step_loras: set[int] = set()  # adapters running or admitted this step
        self.is_closed = False  # an adapter request was refused a slot this step

    # ---- requests arriving and leaving ---------------------------------------------

    def acquire(self, request: Request) -> None:
        """A new request takes its adapter (UnknownLoRAError if it is not registered)."""
        self.registry.acquire(request.lora_id)

    def park_if_unloaded(self, request: Request) -> bool:
        """Park ``request`` (True) unless its adapter is loaded and not draining."""
        adapter = self.registry.by_id[request.lora_id]
        if adapter.state is AdapterState.LOADED and adapter is not self.draining:
            return False
        request.status = RequestStatus.WAITING_FOR_LORA
        adapter.num_parked += 1
        self.parked.append(request)
        return True

    def release(self, request: Request) -> None:
        """A request ends: unpark it if parked, give its adapter back."""
        if request.status is RequestStatus.WAITING_FOR_LORA:
            self.parked.remove(request)
            self.registry.by_id[request.lora_id].num_parked -= 1
        self.registry.release(request.lora_id)

    # ---- each step -----------------------------------------------------------------

    def begin_step(self, running: list[Request]) -> list[Request]:
        """Evict a drained adapter, start loads, and return the parked requests whose
        adapter is now loaded (in arrival order: they go back to the queue's front)."""
        if self.draining is not None and not self.draining.is_in_use:
            if self.draining.state is AdapterState.LOADED:
                self.registry.evict(self.draining)
            self.draining = None
        # Unpark before loading: a just-loaded adapter is then in use by its requests,
        # so no load below can evict it before they ran (that would thrash).
        ready = [r for r in self.parked if self._is_ready(self.registry.by_id[r.lora_id])]
        for request in ready:
            self.parked.remove(request)
            self.registry.by_id[request.lora_id].num_parked -= 1
            request.status = RequestStatus.WAITING
        self._start_loads()
        self.step_loras = {r.lora_id for r in running if r.lora_id}
        self.is_closed = False
        return ready

    def _is_ready(self, adapter: LoRAAdapter) -> bool:
        return adapter.state is AdapterState.LOADED and adapter is not self.draining

    def _start_loads(self) -> None:
        """Loads for parked requests in arrival order, while the cache has room."""
        seen: set[int] = set()
        for request in self.parked:
            adapter = self.registry.by_id[request.lora_id]
            if adapter.lora_id in seen or adapter.state is not AdapterState.ON_DISK:
                continue
            seen.add(adapter.lora_id)
            if adapter is self.draining:
                continue  # it reloads once evicted, in its turn
            if not self.registry.make_room():
                self._drain_one()
                return  # first come, first loaded: later ones wait behind it
            self.registry.load(adapter)

    def _drain_one(self) -> None:
        if self.draining is not None:
            return
        loaded = [a for a in self.registry.by_id.values() if a.state is AdapterState.LOADED]
        self.draining = min(loaded, key=lambda a: a.last_used, default=None)

    # ---- admissions ----------------------------------------------------------------

    def may_admit(self, request: Request) -> bool:
        """Whether ``request`` may start this step (the slot rule of the docstring)."""
        if not request.lora_id:
            return True
        if self.is_closed:
            return False
        if request.lora_id in self.step_loras or len(self.step_loras) < self.max_loras:
            return True
        self.is_closed = True
        return False

    def on_admit(self, request: Request) -> None:
        if request.lora_id:
            self.step_loras.add(request.lora_id)
            self.registry.touch(self.registry.by_id[request.lora_id])

    # ---- what the metrics show -----------------------------------------------------

    @property
    def num_parked(self) -> int:
        return len(self.parked)

    @property
    def num_parked_tokens(self) -> int:
        return sum(r.num_tokens for r in self.parked)

    def names(self, lora_ids) -> list[str]:
        """Adapter names of ``lora_ids`` (unknown and 0 skipped), sorted."""
        by_id = self.registry.by_id
        return sorted({by_id[i].name for i in lora_ids if i in by_id})
