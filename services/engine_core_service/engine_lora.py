"""The engine-core service's LoRA traffic, between the step loop's steps.

    API ──LoadLoRAAdapter / UnloadLoRAAdapter / ListLoRAAdapters──▶ here ──LoRAReply──▶ API
    here ──ApplyLoRACommands──▶ worker ──LoRALoadFinished (off its step loop)──▶ here

The engine core is the one registry every API process asks (engine_core/lora_control.py),
so several API processes always agree on which adapters exist. A runtime load is
answered only once the worker has read and checked the adapter; a reload that fails
later refuses the requests that waited for it.
"""
from __future__ import annotations

from engine_core.engine import EngineCore
from engine_core.lora_registry import LoRALoadResult, UnknownLoRAError
from engine_core.sampling_params import InvalidRequestError
from observability.logging import get_logger
from services.engine_core_service.api_clients import send_to_client
from services.protocol import (ApplyLoRACommands, ListLoRAAdapters, LoadLoRAAdapter,
                               LoRAAdapterInfo, LoRAReply, RequestRejected, UnloadLoRAAdapter)
from services.transport import PeerLink

log = get_logger("services.engine_core")


class EngineLoRA:
    """Answers the API's LoRA requests and relays the worker's commands and results."""

    def __init__(self, engine: EngineCore):
        self.engine = engine
        self.control = engine.lora  # None: LoRA is off
        self.pending: dict[int, tuple[PeerLink, str]] = {}  # lora id → who asked to load it
        self.results: list[LoRALoadResult] = []  # from the worker, applied between steps

    def lora_id_of(self, name: str | None) -> int:
        """The id of the adapter a request names (0: the base model; 404 if unknown)."""
        if name is not None and self.control is None:
            raise UnknownLoRAError(f"model {name[:100]!r} does not exist", "model")
        return self.control.lora_id_of(name) if name is not None else 0

    def adapters(self) -> list[LoRAAdapterInfo]:
        if self.control is None:
            return []
        return [LoRAAdapterInfo(a.name, a.lora_id) for a in self.control.adapters()]

    def list_reply(self, message: ListLoRAAdapters) -> LoRAReply:
        return LoRAReply(message.request_id, True, adapters=self.adapters())

    async def on_request(self, link: PeerLink,
                         message: LoadLoRAAdapter | UnloadLoRAAdapter) -> None:
        """A load (answered when its check ends) or an unload (answered now)."""
        if self.control is None:
            await send_to_client(link, LoRAReply(message.request_id, False,
                                                 "LoRA adapters are off (lora.enable_lora)",
                                                 "not_found"))
            return
        try:
            if isinstance(message, LoadLoRAAdapter):
                adapter = self.control.register(message.lora_name, message.lora_path,
                                                is_checked=False)
                self.pending[adapter.lora_id] = (link, message.request_id)
                return
            adapter = self.control.unregister(message.lora_name)
        except InvalidRequestError as e:
            code = "not_found" if isinstance(message, UnloadLoRAAdapter) else "bad_adapter"
            await send_to_client(link, LoRAReply(message.request_id, False, str(e), code))
            return
        log.info("lora adapter unloaded", lora_name=adapter.name, lora_id=adapter.lora_id,
                 num_requests=adapter.num_requests)
        await send_to_client(link, LoRAReply(message.request_id, True))

    async def send_commands(self, worker: PeerLink) -> None:
        """Loads and evictions the last scheduling decided, to the worker."""
        if self.control is None:
            return
        commands = self.control.take_commands()
        if commands:
            await worker.send(ApplyLoRACommands(commands.evictions, commands.loads))

    async def apply_results(self, owner: dict[str, PeerLink]) -> None:
        """Apply the worker's finished loads: answer registrations, refuse the requests
        of an adapter that could not be reloaded (``owner``: sample id → API link)."""
        results, self.results = self.results, []
        for result in results:
            effect = self.control.on_result(result)
            if effect.registered:
                await self._answer_registration(result, effect.adapter)
            elif effect.refused_req_ids:
                log.error("lora adapter reload failed; refusing its requests",
                          lora_id=result.lora_id, error=result.error,
                          num_requests=len(effect.refused_req_ids))
                await self._refuse(effect.refused_req_ids, result.error, owner)
                self.engine.apply_lora_effects([effect])

    async def _answer_registration(self, result: LoRALoadResult, adapter) -> None:
        link, request_id = self.pending.pop(result.lora_id, (None, ""))
        if result.error is None:
            log.info("lora adapter registered", lora_name=adapter.name, lora_id=adapter.lora_id)
            reply = LoRAReply(request_id, True)
        else:
            log.warning("lora adapter refused", lora_name=adapter.name, error=result.error)
            reply = LoRAReply(request_id, False, f"adapter {adapter.name!r}: {result.error}",
                              "bad_adapter")
        if link is not None:
            await send_to_client(link, reply)

    async def _refuse(self, sample_ids: list[str], error: str | None,
                      owner: dict[str, PeerLink]) -> None:
        requests = self.engine.scheduler.requests
        told = set()
        for sample_id in sample_ids:
            request, link = requests.get(sample_id), owner.get(sample_id)
            api_id = (request.parent_req_id or request.req_id) if request else sample_id
            if link is not None and api_id not in told:
                told.add(api_id)
                await send_to_client(link, RequestRejected(
                    api_id, f"the LoRA adapter could not be loaded: {error}", "model",
                    "lora_load_failed"))
