from collections import deque

from pipellm.engine.sequence import Request


class BlockManager:
    """Hands out KV cache block ids. Every stage indexes its own layers' caches with the same ids."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free_block_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def num_blocks_needed(self, req: Request, num_new_tokens: int) -> int:
        total = req.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(req.block_ids))

    def can_allocate(self, req: Request, num_new_tokens: int) -> bool:
        return self.num_blocks_needed(req, num_new_tokens) <= self.num_free_blocks

    def allocate(self, req: Request, num_new_tokens: int) -> None:
        """Gives req enough blocks to hold num_new_tokens more tokens."""
        needed = self.num_blocks_needed(req, num_new_tokens)
        assert needed <= self.num_free_blocks, "allocate() without can_allocate()"
        req.block_ids.extend(self.free_block_ids.popleft() for _ in range(needed))

    def free(self, req: Request) -> None:
        self.free_block_ids.extend(req.block_ids)
        req.block_ids = []
