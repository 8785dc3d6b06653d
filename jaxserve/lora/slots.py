"""Which adapter holds which device slot: the scheduler's side of multi-LoRA (pure Python).

Slots 1..max_loras hold adapters; slot 0 is the base model (all zeros). A running
sequence holds a reference on its adapter's slot from admission until it finishes or is
preempted, so at most ``max_loras`` distinct adapters run at once; a waiting sequence
whose adapter has no slot and finds none free stays waiting. A slot nobody references
keeps its adapter (a later request for it needs no load) until another adapter needs the
room: then the least recently used such slot is overwritten. The scheduler reports each
overwrite in ``SchedulerOutput.lora_loads`` and the runner writes the weights before the
step (jaxserve/lora/stacks.py): a device update, never a compile.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable


class LoRASlots:
    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self._slot_of: dict[Hashable, int] = {}
        self._key_of: list[Hashable | None] = [None] * (max_loras + 1)
        self._users = [0] * (max_loras + 1)
        self._idle: OrderedDict[int, None] = OrderedDict()    # loaded, unreferenced; LRU first
        self._empty = list(range(max_loras, 0, -1))          # pop() gives slot 1 first

    def acquire(self, key: Hashable) -> tuple[int, bool] | None:
        """A reference on ``key``'s slot: (slot, whether its weights must be written now),
        or None when every slot is referenced by other adapters."""
        slot = self._slot_of.get(key)
        if slot is not None:
            self._idle.pop(slot, None)
            self._users[slot] += 1
            return slot, False
        if self._empty:
            slot = self._empty.pop()
        elif self._idle:
            slot, _ = self._idle.popitem(last=False)
            del self._slot_of[self._key_of[slot]]
        else:
            return None
        self._slot_of[key] = slot
        self._key_of[slot] = key
        self._users[slot] = 1
        return slot, True

    def release(self, slot: int) -> None:
        if slot == 0:
            return
        assert self._users[slot] > 0, slot
        self._users[slot] -= 1
        if self._users[slot] == 0:
            self._idle[slot] = None

    def slot_of(self, key: Hashable) -> int | None:
        return self._slot_of.get(key)

    @property
    def num_active(self) -> int:
        """Slots referenced by running sequences."""
        return sum(1 for users in self._users[1:] if users)
