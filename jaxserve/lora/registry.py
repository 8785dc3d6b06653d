"""Adapters the engine knows: served names, and the host-memory LRU of loaded weights.

Loading reads the PEFT directory, checks it against the base model and builds the padded
stacks (peft_loader.py): milliseconds to seconds, so it never runs inside a step. The
server loads on its own threads (at startup, on POST /v1/load_lora_adapter, and before
submitting a request whose adapter was evicted); `LLM.generate` loads at add_request.
A request holds its `LoadedLoRA`, so eviction from this LRU (``max_cpu_loras``) or an
unload never takes weights from under a request in flight: it only frees the memory once
no request refers to them. Thread-safe (the server's threads and the engine thread).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from jaxserve.lora.peft_loader import LoRAWeights, load_peft_adapter
from jaxserve.lora.request import LoRARequest
from jaxserve.models import partition
from jaxserve.models.arch import ModelArch
from jaxserve.models.family import ModelFamily

logger = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class LoadedLoRA:
    request: LoRARequest
    weights: LoRAWeights

    @property
    def key(self) -> tuple[str, int, str]:
        return self.request.key

    @property
    def name(self) -> str:
        return self.request.lora_name


class LoRARegistry:
    def __init__(self, family: ModelFamily, source_arch: ModelArch, *, max_lora_rank: int,
                 max_cpu_loras: int, tp: int = 1, hub: Any = None) -> None:
        """source_arch: the checkpoint's (adapters are checked against it); tp: KV heads are
        replicated in B of k/v exactly as in the base weights when tp > num_kv_heads.
        hub: the HubOptions (cache, token) an adapter named by its Hub id is fetched with."""
        self.family, self.arch, self.hub = family, source_arch, hub
        self.max_lora_rank, self.max_cpu_loras, self.tp = max_lora_rank, max_cpu_loras, tp
        self._lock = threading.Lock()
        self._served: dict[str, LoRARequest] = {}                    # by name
        self._cache: OrderedDict[tuple, LoadedLoRA] = OrderedDict()  # LRU, newest last

    # -- served names (the server's --lora-modules and runtime loading) ------------------------
    def add(self, request: LoRARequest) -> LoadedLoRA:
        """Load and serve an adapter under its name; ValueError if the name is taken or the
        adapter is bad (nothing changes then)."""
        with self._lock:
            if request.lora_name in self._served:
                raise ValueError(f"The lora adapter '{request.lora_name}' has already been "
                                 "loaded.")
        loaded = self.get(request)
        with self._lock:
            self._served[request.lora_name] = request
        logger.info("LoRA adapter %r (id %d) from %s: rank %d, targets %s",
                    request.lora_name, request.lora_int_id, request.lora_path,
                    loaded.weights.rank, ", ".join(loaded.weights.a))
        return loaded

    def remove(self, name: str) -> LoRARequest:
        """Stop serving ``name`` (KeyError if unknown). Requests already running under it
        finish with it (they hold its weights); new ones naming it are rejected."""
        with self._lock:
            request = self._served.pop(name)
            self._cache.pop(request.key, None)
        logger.info("LoRA adapter %r unloaded", name)
        return request

    def lookup(self, name: str) -> LoRARequest | None:
        with self._lock:
            return self._served.get(name)

    def served(self) -> list[LoRARequest]:
        with self._lock:
            return list(self._served.values())

    def next_int_id(self) -> int:
        with self._lock:
            return 1 + max((r.lora_int_id for r in self._served.values()), default=0)

    # -- weights -----------------------------------------------------------------------------
    def get(self, request: LoRARequest) -> LoadedLoRA:
        """The adapter's weights, from the LRU or loaded now (ValueError if bad)."""
        with self._lock:
            loaded = self._cache.get(request.key)
            if loaded is not None:
                self._cache.move_to_end(request.key)
                return loaded
        weights = load_peft_adapter(request.lora_path, self.family, self.arch,
                                    self.max_lora_rank, hub=self.hub)
        if partition.kv_replication(self.arch, self.tp) > 1:
            weights.b.update(partition.replicate_kv_heads(
                {k: v for k, v in weights.b.items() if k in ("k_proj", "v_proj")},
                self.arch, self.tp, ("k_proj", "v_proj")))
        loaded = LoadedLoRA(request, weights)
        with self._lock:
            self._cache[request.key] = loaded
            while len(self._cache) > self.max_cpu_loras:
                evicted, _ = self._cache.popitem(last=False)
                logger.debug("LoRA host cache full: evicted %r", evicted[0])
        return loaded

    def cached_names(self) -> list[str]:
        with self._lock:
            return [loaded.name for loaded in self._cache.values()]
