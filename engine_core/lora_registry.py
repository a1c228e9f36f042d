"""The engine core's LoRA adapters: names, ids, folders, and which ones the worker holds.

The engine core is the one authority on adapters: every API process resolves names
through it, and it alone decides what the worker loads into and evicts from its host
cache (``lora.max_cpu_loras`` adapters). The worker only executes the commands::

    ON_DISK ──load──▶ LOADING ──ok──▶ LOADED ──evict──▶ ON_DISK
                          └──failed──▶ ON_DISK (its parked requests are refused)

Ids are never reused: an adapter unloaded and loaded again under the same name gets
a new id, so no block hashed under the old weights (the id is in every block hash) can
serve the new ones. An adapter is *in use* while a request that is not parked waiting
for it (queued, running, preempted, waiting to fork) holds it, or while it loads;
adapters in use are never evicted (lora_admission.py decides when one drains).
"""
from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

from engine_core.sampling_params import InvalidRequestError


class UnknownLoRAError(InvalidRequestError):
    """A request names an adapter that is not (or no longer) registered: HTTP 404."""


class AdapterState(enum.Enum):
    """Where an adapter's weights are (see the module docstring)."""

    ON_DISK = "on_disk"
    LOADING = "loading"
    LOADED = "loaded"


@dataclass(slots=True)
class LoRALoad:
    """Engine core → worker: read adapter ``lora_id`` from ``path`` on the loader thread.
    ``keep`` False only checks it (a registration while the host cache is full)."""

    lora_id: int
    name: str
    path: str
    keep: bool = True


@dataclass(slots=True)
class LoRALoadResult:
    """Worker → engine core: a load finished (``error`` None) or failed (why)."""

    lora_id: int
    error: str | None = None


@dataclass(slots=True)
class LoRACommands:
    """What the worker must do next, in order: evictions, then loads."""

    evictions: list[int] = field(default_factory=list)
    loads: list[LoRALoad] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.evictions or self.loads)


@dataclass(slots=True)
class LoRAAdapter:
    """One adapter as the engine core tracks it."""

    name: str
    lora_id: int
    path: str
    state: AdapterState = AdapterState.ON_DISK
    is_registered: bool = True  # False while its first load checks it, and once unloaded
    is_unloaded: bool = False  # unloaded by name: no new requests; dropped when idle
    num_requests: int = 0  # live requests holding it (parked ones included)
    num_parked: int = 0  # of those, parked waiting for it to load
    last_used: int = 0  # registry clock of its last admission (LRU)

    @property
    def is_in_use(self) -> bool:
        return self.state is AdapterState.LOADING or self.num_requests > self.num_parked


def _registered(adapter: LoRAAdapter | None, message: str, param: str) -> LoRAAdapter:
    if adapter is None or not adapter.is_registered:
        raise UnknownLoRAError(message, param)
    return adapter


class LoRARegistry:
    """Adapters by name and id, their states, and the commands the worker still needs."""

    def __init__(self, max_cpu_loras: int):
        self.max_cpu_loras = max_cpu_loras
        self.by_name: dict[str, LoRAAdapter] = {}
        self.by_id: dict[int, LoRAAdapter] = {}
        self._ids = itertools.count(1)
        self.clock = 0
        self._commands = LoRACommands()
        self.num_loads = self.num_evictions = self.num_load_failures = 0

    # ---- names ---------------------------------------------------------------------

    def register(self, name: str, path: str, lora_id: int | None = None, *,
                 is_checked: bool = True) -> LoRAAdapter:
        """A new adapter (``is_checked`` False: invisible until its first load passes)."""
        if not isinstance(name, str) or not 0 < len(name) <= 256:
            raise InvalidRequestError("an adapter name is 1-256 characters", "lora_name")
        if name in self.by_name:
            raise InvalidRequestError(f"an adapter named {name!r} is already loaded",
                                      "lora_name")
        if lora_id is None:
            lora_id = next(i for i in self._ids if i not in self.by_id)
        elif isinstance(lora_id, bool) or not isinstance(lora_id, int) or lora_id < 1:
            raise InvalidRequestError("lora_int_id must be a positive integer", "lora_id")
        elif lora_id in self.by_id:
            raise InvalidRequestError(f"lora_int_id {lora_id} is taken by adapter "
                                      f"{self.by_id[lora_id].name!r}", "lora_id")
        adapter = LoRAAdapter(name, lora_id, path, is_registered=is_checked)
        self.by_name[name] = self.by_id[lora_id] = adapter
        return adapter

    def resolve(self, name: str) -> LoRAAdapter:
        """The registered adapter called ``name`` (UnknownLoRAError otherwise)."""
        return _registered(self.by_name.get(name), f"model {name[:100]!r} does not exist",
                           "model")

    def unregister(self, name: str) -> LoRAAdapter:
        """Unload by name: new requests are refused at once, live ones finish."""
        adapter = self.resolve(name)
        del self.by_name[name]
        adapter.is_registered, adapter.is_unloaded = False, True
        self._drop_if_idle(adapter)
        return adapter

    def registered(self) -> list[LoRAAdapter]:
        return [a for a in self.by_name.values() if a.is_registered]

    # ---- residency -----------------------------------------------------------------

    @property
    def num_resident(self) -> int:
        """Adapters the host cache holds or is loading (at most max_cpu_loras)."""
        return sum(a.state is not AdapterState.ON_DISK for a in self.by_id.values())

    def evictable(self) -> LoRAAdapter | None:
        """The least recently used loaded adapter nobody uses, if any."""
        idle = [a for a in self.by_id.values()
                if a.state is AdapterState.LOADED and not a.is_in_use]
        return min(idle, key=lambda a: a.last_used, default=None)

    def make_room(self) -> bool:
        """Whether one more adapter fits the host cache, evicting an idle one if needed."""
        if self.num_resident < self.max_cpu_loras:
            return True
        victim = self.evictable()
        if victim is None:
            return False
        self.evict(victim)
        return True

    def load(self, adapter: LoRAAdapter, keep: bool = True) -> None:
        """Queue a load (the caller made room when ``keep``)."""
        if keep:
            adapter.state = AdapterState.LOADING
        self._commands.loads.append(LoRALoad(adapter.lora_id, adapter.name, adapter.path,
                                             keep))

    def evict(self, adapter: LoRAAdapter) -> None:
        if adapter.is_in_use:
            raise RuntimeError(f"adapter {adapter.name!r} is in use and cannot be evicted")
        adapter.state = AdapterState.ON_DISK
        self._commands.evictions.append(adapter.lora_id)
        self.num_evictions += 1

    def on_result(self, result: LoRALoadResult) -> LoRAAdapter | None:
        """Record a finished load (a registration's check completes or forgets its
        adapter); the adapter, None if it is unknown."""
        adapter = self.by_id.get(result.lora_id)
        if adapter is None:
            return None
        is_check = not adapter.is_registered and not adapter.is_unloaded
        if result.error is not None:
            self.num_load_failures += 1
            adapter.state = AdapterState.ON_DISK
            if is_check:
                del self.by_name[adapter.name], self.by_id[adapter.lora_id]
                return adapter
        elif adapter.state is AdapterState.LOADING:
            self.num_loads += 1
            adapter.state = AdapterState.LOADED
            self.touch(adapter)  # just loaded: the last to drain
        adapter.is_registered = adapter.is_registered or is_check
        self._drop_if_idle(adapter)
        return adapter

    def take_commands(self) -> LoRACommands:
        commands, self._commands = self._commands, LoRACommands()
        return commands

    # ---- requests ------------------------------------------------------------------

    def registered_id(self, lora_id: int) -> LoRAAdapter:
        """The registered adapter with id ``lora_id`` (UnknownLoRAError otherwise)."""
        return _registered(self.by_id.get(lora_id), f"no LoRA adapter has id {lora_id}",
                           "lora_id")

    def acquire(self, lora_id: int) -> LoRAAdapter:
        """A new request holds adapter ``lora_id`` (an unloaded name takes no more)."""
        adapter = self.registered_id(lora_id)
        adapter.num_requests += 1
        return adapter

    def release(self, lora_id: int) -> None:
        adapter = self.by_id[lora_id]
        adapter.num_requests -= 1
        self._drop_if_idle(adapter)

    def touch(self, adapter: LoRAAdapter) -> None:
        self.clock += 1
        adapter.last_used = self.clock

    def _drop_if_idle(self, adapter: LoRAAdapter) -> None:
        """Forget an unloaded adapter once no request holds it (a load in flight is
        waited for: its result evicts it)."""
        if not adapter.is_unloaded or adapter.num_requests or \
                adapter.state is AdapterState.LOADING:
            return
        if adapter.state is AdapterState.LOADED:
            self.evict(adapter)
        self.by_id.pop(adapter.lora_id, None)
