"""The LoRA adapters a server serves, kept in Redis so that every gateway of it
(--api-server-count) sees one set: what one gateway loads, the others serve and list.

A hash (keys.LORA_ADAPTERS) maps each name to its adapter as JSON; ids come from one
counter (keys.LORA_IDS), so every adapter loaded gets a lora_int_id of its own, also a
name loaded again after an unload: the worker and the prefix cache key on the id and must
never take one adapter's weights for another's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import anyio

from common import keys
from common.bus import Bus
from common.errors import ApiError
from common.lora import AdapterError, LoRAModule, read_adapter_config
from common.messages import LoRARequest


@dataclass(frozen=True, slots=True)
class Adapter:
    lora: LoRARequest
    parent: str  # the base model's served name, /v1/models' parent

    def to_json(self) -> str:
        lora = self.lora
        return json.dumps({"name": lora.lora_name, "id": lora.lora_int_id,
                           "path": lora.lora_path, "parent": self.parent})

    @classmethod
    def from_json(cls, raw: bytes) -> Adapter:
        item = json.loads(raw)
        return cls(LoRARequest(item["name"], item["id"], item["path"]), item["parent"])


def named(adapters: dict[str, Adapter], name: str | None, lora_int_id: int | None
          ) -> Adapter:
    """The adapter an unload names by lora_name or lora_int_id (both: they must agree)."""
    if name is None and lora_int_id is None:
        raise ApiError(400, "Give lora_name (or lora_int_id) of the adapter to unload.",
                       "lora_name")
    for adapter in adapters.values():
        if name in (None, adapter.lora.lora_name) and \
                lora_int_id in (None, adapter.lora.lora_int_id):
            return adapter
    given = name if name is not None else f"with lora_int_id {lora_int_id}"
    raise ApiError(404, f"The LoRA adapter {given!r} is not loaded.", "lora_name")


def check_new_name(name: str, base_names: list[str]) -> None:
    if name in base_names:
        raise ApiError(400, f"The name {name!r} is the base model's; give the adapter "
                            "another.", "lora_name")


async def check_adapter(path: str, max_rank: int) -> None:
    """An adapter that would fail in the worker is refused when loaded, with the reason."""
    try:
        await anyio.to_thread.run_sync(read_adapter_config, path, max_rank)
    except AdapterError as e:
        raise ApiError(400, str(e), "lora_path") from None


class Adapters:
    """The shell over the shared hash; decisions are the functions above."""

    def __init__(self, bus: Bus, parent: str, max_rank: int) -> None:
        self.bus, self.parent, self.max_rank = bus, parent, max_rank

    async def all(self) -> dict[str, Adapter]:
        items = await self.bus.hash_items(keys.LORA_ADAPTERS)
        return {name: Adapter.from_json(raw) for name, raw in items.items()}

    async def get(self, name: str) -> Adapter | None:
        raw = await self.bus.hash_value(keys.LORA_ADAPTERS, name)
        return None if raw is None else Adapter.from_json(raw)

    async def load(self, name: str, path: str, parent: str | None = None) -> bool:
        """Add an adapter (after checking it); False if the name is taken."""
        await check_adapter(path, self.max_rank)
        adapter = await self._new(name, path, parent)
        return await self.bus.hash_set(keys.LORA_ADAPTERS, name, adapter.to_json(),
                                       only_new=True)

    async def unload(self, name: str | None, lora_int_id: int | None) -> Adapter:
        adapter = named(await self.all(), name, lora_int_id)
        if not await self.bus.hash_delete(keys.LORA_ADAPTERS, adapter.lora.lora_name):
            raise ApiError(404, f"The LoRA adapter {adapter.lora.lora_name!r} is not "
                                "loaded.", "lora_name")  # another gateway unloaded it
        return adapter

    async def register(self, modules: list[LoRAModule], base_names: list[str]) -> None:
        """--lora-modules, at a gateway's start: each gateway of the server registers them;
        the first to do so gives the ids, and an entry a former server left under one of
        these names with another path is replaced."""
        for module in modules:
            check_new_name(module.name, base_names)
            if await self.load(module.name, module.path, module.base_model_name):
                continue
            known = await self.get(module.name)
            if known is None or known.lora.lora_path != module.path:
                adapter = await self._new(module.name, module.path, module.base_model_name)
                await self.bus.hash_set(keys.LORA_ADAPTERS, module.name, adapter.to_json())

    async def _new(self, name: str, path: str, parent: str | None) -> Adapter:
        lora_int_id = await self.bus.increment(keys.LORA_IDS)
        return Adapter(LoRARequest(name, lora_int_id, path), parent or self.parent)
