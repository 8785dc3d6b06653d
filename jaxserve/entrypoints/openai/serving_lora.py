"""LoRA adapters over HTTP: `--lora-modules`, model cards, and vLLM's runtime loading.

    POST /v1/load_lora_adapter    {"lora_name": "sql", "lora_path": "/path/a"}
    POST /v1/unload_lora_adapter  {"lora_name": "sql"}

(served only with --allow-runtime-lora-updating, vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING
as a flag). A bad adapter is a 400 naming the problem and changes nothing; unloading an
unknown name is a 404. Unload follows vLLM: the name leaves the registry at once (new
requests naming it get 404), while requests already admitted under it run to the end
with its weights; its device slot is reused once they finish.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from pydantic import BaseModel

from jaxserve.entrypoints.openai.errors import APIError
from jaxserve.lora.request import LoRARequest

logger = logging.getLogger(__name__)


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None


def parse_lora_modules(specs: list[str] | None) -> list[tuple[str, str]]:
    """``["sql=/path/a", ...]`` -> [(name, path)]; ValueError naming a malformed entry."""
    modules = []
    for spec in specs or ():
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules entry {spec!r} is not NAME=PATH")
        modules.append((name, path))
    return modules


class OpenAIServingLoRA:
    def __init__(self, registry: Any, base_model_name: str) -> None:
        self.registry = registry          # None: LoRA off
        self.base_model_name = base_model_name
        self.created = int(time.time())

    def load_startup_modules(self, specs: list[str] | None) -> None:
        modules = parse_lora_modules(specs)
        if modules and self.registry is None:
            raise ValueError("--lora-modules needs --enable-lora")
        for name, path in modules:
            self.registry.add(LoRARequest(name, self.registry.next_int_id(), path))

    def model_cards(self, max_model_len: int) -> list[dict[str, Any]]:
        """One card per served adapter, its parent the base model (vLLM's shape)."""
        if self.registry is None:
            return []
        return [{"id": r.lora_name, "object": "model", "created": self.created,
                 "owned_by": "jaxserve", "root": r.lora_path, "parent": self.base_model_name,
                 "max_model_len": max_model_len} for r in self.registry.served()]

    async def load(self, request: LoadLoRAAdapterRequest) -> str:
        self._check_enabled()
        if not request.lora_name or not request.lora_path:
            raise APIError("Both 'lora_name' and 'lora_path' must be provided.",
                           param="lora_name")
        if request.lora_name == self.base_model_name:
            raise APIError(f"'{request.lora_name}' is the base model's name", param="lora_name")
        lora = LoRARequest(request.lora_name, self.registry.next_int_id(), request.lora_path)
        try:   # reading and checking the adapter happens off the event loop
            await asyncio.to_thread(self.registry.add, lora)
        except ValueError as exc:
            raise APIError(str(exc), param="lora_path") from None
        return f"Success: LoRA adapter '{request.lora_name}' added successfully."

    async def unload(self, request: UnloadLoRAAdapterRequest) -> str:
        self._check_enabled()
        try:
            self.registry.remove(request.lora_name)
        except KeyError:
            raise APIError(f"The lora adapter '{request.lora_name}' cannot be found.", 404,
                           "NotFoundError", param="lora_name") from None
        return f"Success: LoRA adapter '{request.lora_name}' removed successfully."

    def _check_enabled(self) -> None:
        if self.registry is None:
            raise APIError("this server was started without --enable-lora", param="lora_name")
