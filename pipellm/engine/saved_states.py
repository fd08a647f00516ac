"""Which prefixes' states the stages keep: prefix caching for models whose layers keep a state per sequence.

A layer that keeps a state (a gated delta net's, a Mamba mixer's) cannot take a cached prefix from its blocks' K/V:
it needs its state after exactly those tokens. The stages save such states in numbered slots, mid-step where a
sequence passes the end of a chosen block, and this index names each slot by the chained hash of the blocks before
it (BlockManager's). A request takes a cached prefix of full blocks only as far as the last of them with a saved
state, which the stages copy into its row before its first step.

Where a request saves its state: at the end of the last full block before its prompt's last token (a repeated
prompt, and a longer one that goes on from it, start there); where its cached blocks end when that is past its
saved state (where it and an earlier prompt part: a system prompt many requests share gets a saved state as soon as
two of them met there); and as it decodes, at the end of each block, keeping only the latest (a conversation's next
turn starts after the reply). Slots are few (max_num_seqs): a new save takes the least recently used one.
"""
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from pipellm.engine.sequence import Request


class SavedStates:
    def __init__(self, num_slots: int):
        self.slots: OrderedDict[bytes, int] = OrderedDict()  # prefix hash -> slot; least recently used first
        self.free = list(range(num_slots))[::-1]
        self.loads: list[tuple[int, int]] = []  # (slot, row) the batch being built copies before it runs
        self.taken: set[int] = set()            # slots the batch being built saves into

    def longest(self, hashes: Sequence[bytes]) -> int:
        """How many of these first blocks (those cached) a request may take: up to the last with a saved state."""
        for j in range(len(hashes), 0, -1):
            if hashes[j - 1] in self.slots:
                return j
        return 0

    def load(self, prefix: bytes, row: int) -> None:
        self.slots.move_to_end(prefix)
        self.loads.append((self.slots[prefix], row))

    def saves(self, reqs: list[Request], starts: np.ndarray, counts: np.ndarray, block_size: int,
              steps: int = 1) -> np.ndarray | None:
        """The batch's saves [K, 3] (sequence, after how many of its new tokens, slot): the planned ones that its
        tokens reach, and a decode step's that ends a block of known tokens (the request's latest such state
        replaces its one before). Ends the batch: its slots' reservations are handed out."""
        out = []
        for i, (req, start, n) in enumerate(zip(reqs, starts.tolist(), counts.tolist())):
            while req.state_saves and req.state_saves[0] * block_size <= start + n:
                p = req.state_saves.pop(0)
                slot = self._slot(req.block_hashes[p - 1])
                if slot is not None:
                    out.append((i, p * block_size - start, slot))
            end = (start + n) // block_size
            # (the hash is there once its tokens are known: not a token sampled by a batch still out)
            if n == 1 and steps == 1 and (start + n) % block_size == 0 and len(req.block_hashes) >= end:
                slot = self._slot(req.block_hashes[end - 1])
                if slot is not None:
                    if req.decode_saved in self.slots:  # its state a block ago: this one goes on from it
                        self.free.append(self.slots.pop(req.decode_saved))
                    req.decode_saved = req.block_hashes[end - 1]
                    out.append((i, 1, slot))
        self.taken.clear()
        return np.array(out, dtype=np.int64) if out else None

    def clear(self) -> None:
        self.free += list(self.slots.values())
        self.slots.clear()

    def take_loads(self) -> np.ndarray | None:
        loads, self.loads = self.loads, []
        return np.array(loads, dtype=np.int64) if loads else None

    def _slot(self, prefix: bytes) -> int | None:
        """A slot for the state after prefix: a free one, else the least recently used one that this batch does not
        save into (the stages save in their own order within a batch). None if prefix has one, or none is left."""
        if prefix in self.slots:
            self.slots.move_to_end(prefix)
            return None
        if self.free:
            slot = self.free.pop()
        else:
            victim = next((h for h, s in self.slots.items() if s not in self.taken), None)
            if victim is None:
                return None
            slot = self.slots.pop(victim)
        self.slots[prefix] = slot
        self.taken.add(slot)
        return slot
