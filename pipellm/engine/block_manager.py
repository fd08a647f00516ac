"""Hands out KV cache block ids, and keeps computed full blocks for later prompts that start the same way.

Every stage indexes its own layers' caches with the same ids, so a block cached here is cached on every stage.
Sliding-window layers need only the last window of keys: with window_ring, they have blocks of their own, and each
sequence cycles through a ring of at most window_ring of them (logical block j in ring slot j % window_ring), so the
blocks that fell out of the window are reused in place.
A full block is named by a chained hash of its tokens and the previous block's hash: one hash stands for the whole
prefix up to the end of that block, so equal tokens after a different prefix never match.
With reuse_partial, the last, partly filled block of a request that ends is kept too, named by the hash of the
blocks before it and each run of tokens it starts with. A later request whose next tokens after its cached full
blocks are one of those (a beam search's next step, a conversation's next turn) takes the block over when no one
holds it, or else gets a copy of it, which the stages make at the start of the batch that admits it
(pending_copies): either way it runs only its tokens after them.
With saved (a model whose layers keep a state per sequence), a cached prefix is taken only as far as a saved state
goes (saved_states.py), and no partial block is.
"""
import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence

from pipellm.engine.saved_states import SavedStates
from pipellm.engine.sequence import Request


def hash_block(parent: bytes, token_ids: list[int]) -> bytes:
    # sha256, not hash(): a collision would silently give one prompt another prompt's K/V.
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True, num_window_blocks: int = 0,
                 window_ring: int = 0, reuse_partial: bool = False, saved: SavedStates | None = None):
        self.num_blocks, self.block_size, self.enable_caching = num_blocks, block_size, enable_caching
        assert not (window_ring and enable_caching), "a ring holds no prefix to share"
        self.saved = saved if enable_caching else None
        self.reuse_partial = enable_caching and reuse_partial and saved is None
        self.partial: dict[tuple[bytes, tuple[int, ...]], int] = {}  # (hash before, tokens) -> a block starting so
        self.partial_keys: dict[int, list[tuple]] = {}           # block -> its keys in partial
        self.pending_copies: list[tuple[int, int]] = []          # (source, new block) for the next batch
        self.window_ring = window_ring                           # blocks a sequence's window layers use at most
        self.window_free: deque[int] = deque(range(num_window_blocks))
        self.ref_counts = [0] * num_blocks                       # requests holding each block
        self.block_hashes: list[bytes | None] = [None] * num_blocks  # set once the block is full and computed
        self.cached: dict[bytes, int] = {}                       # hash -> the one block indexed under it
        self.free_ids: deque[int] = deque(range(num_blocks))     # unreferenced, holding nothing worth keeping
        self.evictable: OrderedDict[int, None] = OrderedDict()   # unreferenced but cached; least recently freed first
        self.free_rows: list[int] = []                           # rows of the stages' block tables no one holds
        self.num_rows = 0
        self.num_prefix_queries = 0                              # tokens of admitted requests looked up
        self.num_prefix_hits = 0                                 # of those, tokens found in the cache

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_ids) + len(self.evictable)

    @property
    def num_shared_blocks(self) -> int:
        """Blocks that more than one request holds (prefix caching)."""
        return sum(c > 1 for c in self.ref_counts)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def prefix_hit_rate(self) -> float:
        return self.num_prefix_hits / self.num_prefix_queries if self.num_prefix_queries else 0.0

    def cached_prefix(self, req: Request) -> list[int]:
        """The blocks that hold req's longest cached prefix of full blocks."""
        if not self.enable_caching:
            return []
        # At most (num_tokens - 1) // block_size blocks: the last token must run to give logits, and it may not be
        # written into a shared block, so a fully cached prompt recomputes its whole last block.
        num_blocks = (req.num_tokens - 1) // self.block_size
        self._hash_blocks(req, num_blocks)
        ids = []
        for h in req.block_hashes[:num_blocks]:
            if h not in self.cached:
                break
            ids.append(self.cached[h])
        if self.saved is not None:
            return ids[:self.saved.longest(req.block_hashes[:len(ids)])]
        return ids

    def cached_partial(self, req: Request, cached: Sequence[int]) -> tuple[int, int] | None:
        """(block, k): a kept partial block whose first k tokens are req's next ones after its cached full blocks,
        the longest there is; k leaves at least req's last token to run. None if there is none."""
        if not self.reuse_partial:
            return None
        bs, start = self.block_size, len(cached) * self.block_size
        before = req.block_hashes[len(cached) - 1] if cached else req.cache_salt
        for k in range(min(bs - 1, req.num_tokens - 1 - start), 0, -1):
            b = self.partial.get((before, tuple(req.token_ids(start, start + k))))
            if b is not None and b not in cached:
                return b, k
        return None

    def num_blocks_needed(self, req: Request, num_new_tokens: int, cached: Sequence[int] = (),
                          partial: tuple[int, int] | None = None) -> int:
        total = req.num_computed_tokens + len(cached) * self.block_size + num_new_tokens
        taken = partial is not None and self.ref_counts[partial[0]] == 0  # taken over: not a new block
        if partial is not None:
            total += partial[1]
        return max(0, -(-total // self.block_size) - len(req.block_ids) - len(cached) - taken)

    def _window_blocks_needed(self, req: Request, num_new_tokens: int) -> int:
        if not self.window_ring:
            return 0
        total = req.num_computed_tokens + num_new_tokens
        return max(0, min(-(-total // self.block_size), self.window_ring) - len(req.window_block_ids))

    def can_allocate(self, req: Request, num_new_tokens: int, cached: Sequence[int] = (),
                     partial: tuple[int, int] | None = None) -> bool:
        # Taking a cached block that nobody holds takes it out of the free count too.
        held = [*cached, partial[0]] if partial else cached
        num_revived = sum(self.ref_counts[b] == 0 for b in held)
        return self.num_blocks_needed(req, num_new_tokens, cached, partial) + num_revived <= self.num_free_blocks \
            and self._window_blocks_needed(req, num_new_tokens) <= len(self.window_free)

    def allocate(self, req: Request, num_new_tokens: int, cached: Sequence[int] = (),
                 partial: tuple[int, int] | None = None) -> None:
        """Gives req enough blocks for num_new_tokens more tokens. A request's first allocate() is its admission:
        it takes the cached prefix blocks (from cached_prefix, and cached_partial's) first; they count as computed."""
        assert not req.in_flight, "allocate() while the request's batch is out"
        assert self.can_allocate(req, num_new_tokens, cached, partial), "allocate() without can_allocate()"
        if req.block_ids:
            assert not cached and not partial, "cached blocks are taken on admission only"
            self.cache_sent_blocks(req)
        else:
            self._admit(req, cached, partial)
        req.block_ids.extend(self._take_free() for _ in range(self.num_blocks_needed(req, num_new_tokens)))
        req.window_block_ids.extend(self.window_free.popleft()
                                    for _ in range(self._window_blocks_needed(req, num_new_tokens)))
        # The blocks this step writes into belong to req alone and are not in the cache, but those full of its own
        # known tokens, which the batch being built writes and a prompt admitted into it may share (cache_sent_blocks)
        start = req.num_computed_tokens // self.block_size
        assert all(self.ref_counts[b] == 1 and self.block_hashes[b] is None or
                   i < len(req.block_hashes) and self.block_hashes[b] == req.block_hashes[i]
                   for i, b in enumerate(req.block_ids[start:], start))

    def allocate_ahead(self, req: Request, num_new_tokens: int) -> None:
        """Slots for num_new_tokens past those of req's batch out: the token that batch samples (async scheduling,
        one stage) or a prompt's next chunk (several stages). Every stage runs batches in the order they were sent,
        so the batch out writes its K/V before a later batch reads it, and reads a sliding window's ring slot before
        the next chunk writes over it."""
        assert req.in_flight
        assert self.can_allocate(req, num_new_tokens), "allocate_ahead() without can_allocate()"
        req.block_ids.extend(self._take_free() for _ in range(self.num_blocks_needed(req, num_new_tokens)))
        req.window_block_ids.extend(self.window_free.popleft()
                                    for _ in range(self._window_blocks_needed(req, num_new_tokens)))

    def free(self, req: Request) -> None:
        assert not req.in_flight, "free() while the request's batch is out: its blocks are still being written"
        self.cache_sent_blocks(req)
        for b in req.block_ids:
            self.ref_counts[b] -= 1
            assert self.ref_counts[b] >= 0
        released = [b for b in req.block_ids if self.ref_counts[b] == 0]
        self._keep_partial(req)
        # Cached blocks queue for eviction tail first: others are likelier to share a prompt's head, and a chain is
        # useless past its first evicted block.
        for b in reversed(released):
            h = self.block_hashes[b]
            if h is not None and self.cached.setdefault(h, b) == b or b in self.partial_keys:
                self.evictable[b] = None  # indexed, or takes over from an evicted twin, or a kept partial block
        for b in released:
            if b not in self.evictable:
                self.block_hashes[b] = None  # unhashed, or a second copy of a cached block: nothing to keep
                self.free_ids.append(b)
        req.block_ids = []
        self.window_free.extend(req.window_block_ids)
        req.window_block_ids = []
        if req.table_row >= 0:  # its batches are back: none still reads the row
            self.free_rows.append(req.table_row)
            req.table_row = -1

    def reset_cache(self) -> bool:
        """Forgets every cached block, kept partial block and saved state; False (and nothing forgotten) while a
        request holds blocks."""
        if any(self.ref_counts):
            return False
        self.cached.clear()
        self.partial.clear()
        self.partial_keys.clear()
        self.block_hashes = [None] * self.num_blocks
        self.evictable.clear()
        self.free_ids = deque(range(self.num_blocks))
        if self.saved is not None:
            self.saved.clear()
        return True

    def cache_sent_blocks(self, req: Request, num_sending: int = 0) -> None:
        """Indexes req's full blocks of known tokens whose K/V is in the cache or written by batches out: every stage
        runs batches in the order they were sent, so a later prompt that takes them reads them after they are
        written. The scheduler calls this as it sends a batch: a prompt admitted into the next batch, while this one
        is still in the pipeline, already finds them. num_sending: req's tokens in the batch being built, whose
        blocks a prompt admitted into that same batch may take too (each layer writes the batch's K/V before any of
        its attention reads it)."""
        if not self.enable_caching:
            return
        # tokens past num_tokens (drafts, multi-step's) are not known yet, nor is a run-ahead's (num_ahead, which
        # num_tokens counts): a block hashed with its placeholder would match a sibling's of another token there
        num_full = min(req.num_computed_tokens + num_sending, req.num_tokens - req.num_ahead) // self.block_size
        start = num_full
        while start > 0 and self.block_hashes[req.block_ids[start - 1]] is None:  # hashed blocks form a prefix
            start -= 1
        self._hash_blocks(req, num_full)
        for i in range(start, num_full):
            b, h = req.block_ids[i], req.block_hashes[i]
            self.block_hashes[b] = h
            self.cached.setdefault(h, b)  # a second copy (computed at the same time) is not indexed

    # ---- internals ------------------------------------------------------------------------------------------

    def _new_row(self) -> int:
        self.num_rows += 1
        return self.num_rows - 1

    def _hash_blocks(self, req: Request, num_blocks: int) -> None:
        bs, hashes = self.block_size, req.block_hashes  # kept on req: its full blocks never change
        for i in range(len(hashes), num_blocks):
            hashes.append(hash_block(hashes[-1] if hashes else req.cache_salt,
                                     req.token_ids(i * bs, (i + 1) * bs)))

    def _is_cached(self, block_id: int) -> bool:
        h = self.block_hashes[block_id]
        return h is not None and self.cached.get(h) == block_id

    def _keep_partial(self, req: Request) -> None:
        """Indexes req's partly filled last block of known, computed tokens, when it is released."""
        if not self.reuse_partial:
            return
        known = min(req.num_computed_tokens, req.num_tokens - req.num_ahead)
        j, k = divmod(known, self.block_size)
        b = req.block_ids[j] if k and j < len(req.block_ids) else None
        if b is None or self.ref_counts[b] or self.block_hashes[b] is not None:  # still held, or full
            return
        self._hash_blocks(req, j)
        before = req.block_hashes[j - 1] if j else req.cache_salt
        tokens = req.token_ids(j * self.block_size, known)
        for n in range(1, k + 1):
            key = (before, tuple(tokens[:n]))
            if key not in self.partial:
                self.partial[key] = b
                self.partial_keys.setdefault(b, []).append(key)

    def _forget_partial(self, block_id: int, keep_upto: int = 0) -> None:
        """Drops the block's partial keys, but those of at most keep_upto tokens (still what it starts with)."""
        keys = self.partial_keys.pop(block_id, [])
        for key in keys:
            if len(key[1]) > keep_upto:
                del self.partial[key]
        kept = [key for key in keys if len(key[1]) <= keep_upto]
        if kept:
            self.partial_keys[block_id] = kept

    def _admit(self, req: Request, cached: Sequence[int], partial: tuple[int, int] | None = None) -> None:
        assert req.num_computed_tokens == 0
        for b in cached:
            assert self._is_cached(b)
            if self.ref_counts[b] == 0:
                del self.evictable[b]
            self.ref_counts[b] += 1
        req.block_ids = list(cached)
        req.num_computed_tokens = len(cached) * self.block_size
        if partial is not None:
            src, k = partial
            if self.ref_counts[src] == 0:  # no one holds it: req takes it over, and writes on after its k tokens
                del self.evictable[src]
                self.ref_counts[src] = 1
                if self.block_hashes[src] is not None:  # filled since: its later tokens are not req's
                    del self.cached[self.block_hashes[src]]
                    self.block_hashes[src] = None
                self._forget_partial(src, keep_upto=k)  # req writes over what came after its k tokens
                req.block_ids.append(src)
            else:  # held by a request that writes on in it: a copy, made before this batch runs
                dst = self._take_free()
                self.pending_copies.append((src, dst))
                req.block_ids.append(dst)
            req.num_computed_tokens += k
        if req.table_row < 0:
            req.table_row = self.free_rows.pop() if self.free_rows else self._new_row()
        if self.saved is not None:
            self._plan_saves(req, len(cached))
        req.blocks_sent = 0
        if self.enable_caching:
            self.num_prefix_queries += req.num_tokens
            self.num_prefix_hits += req.num_computed_tokens

    def _plan_saves(self, req: Request, start: int) -> None:
        """req's state loaded from the saved one its start block ends (if it starts past 0), and where it saves its
        own (in blocks, saved_states.py): where earlier prompts' cached blocks it shares end, and where the most
        blocks a later request may take from it end."""
        if start:
            self.saved.load(req.block_hashes[start - 1], req.table_row)
        last = (req.num_tokens - 1) // self.block_size
        self._hash_blocks(req, last)
        shared = start
        while shared < last and req.block_hashes[shared] in self.cached:
            shared += 1
        req.state_saves = sorted({p for p in (shared, last) if p > start})

    def _take_free(self) -> int:
        # An empty block first; else evict the least recently freed cached one.
        if self.free_ids:
            b = self.free_ids.popleft()
        else:
            b, _ = self.evictable.popitem(last=False)
            if self.block_hashes[b] is not None:
                del self.cached[self.block_hashes[b]]
            self.block_hashes[b] = None
            self._forget_partial(b)
        assert self.ref_counts[b] == 0
        self.ref_counts[b] = 1
        return b
