"""Live retune of ``lora.adapters``: the YAML's adapter list applied to a running stack.

An edit of the list becomes the same loads and unloads that ``/v1/load_lora_adapter``
and ``/v1/unload_lora_adapter`` make, queued in the step loop's inbox (applied between
steps) and answered once the worker has read and checked each new adapter. New and
re-pointed adapters are loaded first, before any other key of the reload is applied:
if the worker refuses one, the reload is invalid (a bad value) and every change made for it is
undone (loaded ones unloaded, a re-pointed one loaded from its old path again), so
the stack keeps its old adapters and its old config. Removed adapters go last, like
an unload: requests already using them finish.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

from config.lora import LoRAAdapterConfig, LoRAConfig
from services.protocol import LoadLoRAAdapter, LoRAReply, UnloadLoRAAdapter

ADAPTER_CHECK_TIMEOUT_S = 120.0  # the worker reads and checks each new adapter's files


@dataclass(frozen=True, slots=True)
class AdapterChange:
    """What an edit of ``lora.adapters`` asks for: ``load`` the new entries (a changed
    path counts as both ``unload`` of the old and ``load`` of the new)."""

    load: tuple[LoRAAdapterConfig, ...]
    unload: tuple[LoRAAdapterConfig, ...]

    @classmethod
    def between(cls, running: LoRAConfig, new: LoRAConfig) -> "AdapterChange":
        old = {a.name: a for a in running.adapters}
        wanted = {a.name: a for a in new.adapters}
        return cls(tuple(a for a in new.adapters if old.get(a.name) != a),
                   tuple(a for a in running.adapters if wanted.get(a.name) != a))


class _ReplySink:
    """Stands in for an API process's link: keeps the engine core's one LoRAReply."""

    closed = False
    name = "config-reload"

    def __init__(self):
        self.reply: asyncio.Future[LoRAReply] = asyncio.get_running_loop().create_future()

    async def send(self, message: LoRAReply) -> None:
        if not self.reply.done():
            self.reply.set_result(message)


class AdapterRetune:
    """Applies an AdapterChange through the engine-core service's inbox."""

    def __init__(self, core):
        self.core = core  # the EngineCoreService

    async def _ask(self, message: LoadLoRAAdapter | UnloadLoRAAdapter) -> LoRAReply:
        sink = _ReplySink()
        self.core.inbox.append((sink, message))
        self.core._wake.set()
        return await asyncio.wait_for(sink.reply, ADAPTER_CHECK_TIMEOUT_S)

    async def _load(self, adapter: LoRAAdapterConfig) -> LoRAReply:
        return await self._ask(LoadLoRAAdapter(f"config-reload-{adapter.name}",
                                               adapter.name, adapter.path))

    async def _unload(self, adapter: LoRAAdapterConfig) -> LoRAReply:
        return await self._ask(UnloadLoRAAdapter(f"config-reload-{adapter.name}",
                                                 adapter.name))

    async def load(self, change: AdapterChange) -> str | None:
        """Load every new or re-pointed adapter; on the first refusal undo them all and
        return why (None: all are served now)."""
        repointed = {a.name: a for a in change.unload}
        done: list[LoRAAdapterConfig] = []
        for adapter in change.load:
            old = repointed.get(adapter.name)
            if old is not None:
                await self._unload(old)
            reply = await self._load(adapter)
            if reply.ok:
                done.append(adapter)
                continue
            for loaded in done:
                await self._unload(loaded)
            for back in [repointed[a.name] for a in (*done, adapter) if a.name in repointed]:
                await self._load(back)
            return f"adapter {adapter.name!r}: {reply.message}"
        return None

    async def unload(self, change: AdapterChange) -> None:
        """Unload the adapters the new list dropped (re-pointed ones were swapped by
        :meth:`load`)."""
        loaded = {a.name for a in change.load}
        for adapter in change.unload:
            if adapter.name not in loaded:
                await self._unload(adapter)
