"""Which LoRA adapter each of the stages' max_loras slots holds (the driver's side of pipellm/lora.py). A request
takes its adapter's slot as it is admitted; an adapter no slot holds is loaded into the least recently used slot
that no running request needs (the stages load it before the batch it is first in), or the request waits while
others go ahead. Stages run batches in order, so a slot reloaded for batch k + 1 still held the old adapter for
batch k. An adapter is known by its LoRARequest and its requests' cache salt, which is new each time an adapter is
added (Adapters): one removed and added again under its name and id is loaded again."""
import os

from pipellm.engine.sequence import Request
from pipellm.pipeline.messages import LoRALoad


class LoRASlots:
    def __init__(self, max_loras: int):
        self.held: list[tuple | None] = [None] * max_loras  # the adapter each slot holds on the stages (_key)
        self.used: list[int] = [0] * max_loras              # when a request last took it
        self.clock = 0
        self.pending: list[LoRALoad] = []                   # loads for the next batch

    def slot_for(self, req: Request, running: list[Request]) -> int | None:
        """The slot that holds req's adapter, or that it would be loaded into (-1: req runs none); None while every
        slot holds another adapter that a running request needs."""
        if req.lora_request is None:
            return -1
        if _key(req) in self.held:
            return self.held.index(_key(req))
        busy = {r.lora_slot for r in running}
        free = [s for s in range(len(self.held)) if s not in busy]
        return min(free, key=lambda s: (self.held[s] is not None, self.used[s])) if free else None

    def take(self, req: Request, slot: int) -> None:
        """req runs in slot (slot_for's), its adapter loaded there with the next batch unless it is already."""
        req.lora_slot = slot
        if slot < 0:
            return
        if self.held[slot] != _key(req):
            self.held[slot] = _key(req)
            load = LoRALoad(slot, os.path.abspath(req.lora_request.lora_path))
            self.pending = [p for p in self.pending if p.slot != slot] + [load]
        self.clock += 1
        self.used[slot] = self.clock

    def take_loads(self) -> list[LoRALoad]:
        loads, self.pending = self.pending, []
        return loads

    def reset(self) -> None:
        """New stages (a pipeline restart) hold no adapter."""
        self.held, self.pending = [None] * len(self.held), []


def _key(req: Request) -> tuple:
    return req.lora_request, req.cache_salt
