"""A stage's copy of the block tables: a row per sequence that holds blocks, kept up to date by each batch's
BlockTableChanges. Every stage gets every batch, in the order the driver sent them, so every stage's copy is the same.
"""
import numpy as np

from pipellm.pipeline.messages import MAX_ROWS, BlockTableChanges


class StageBlockTables:
    def __init__(self):
        self.table = np.zeros((0, 0), dtype=np.int32)  # [rows, blocks], 0 past each row's length; grown on demand
        self.lens: list[int] = []                      # blocks each row holds

    def apply(self, c: BlockTableChanges, num_seqs: int, batch_id: int) -> np.ndarray:
        """Applies the changes; returns the batch's block tables [num_seqs, longest], padded with 0. (Plain Python
        over the few rows of a batch: a dozen numpy calls on arrays this small cost more.)"""
        def need(ok, what):
            if not ok:
                raise ValueError(f"StageBatch {batch_id}: table_changes {what}")

        arrays = (c.rows, c.keep, c.num_new, c.new_ids)
        need(all(a.ndim == 1 and a.dtype.kind == "i" for a in arrays), "must be 1-D integer arrays")
        rows, keep, num_new = c.rows.tolist(), c.keep.tolist(), c.num_new.tolist()
        need(len(rows) == len(keep) == len(num_new) == num_seqs > 0, "must have one entry a sequence")
        need(len(set(rows)) == num_seqs and min(rows) >= 0 and max(rows) < MAX_ROWS,
             f"rows must be distinct, 0 to {MAX_ROWS - 1}")
        need(min(keep) >= 0 and min(num_new) >= 0 and sum(num_new) == len(c.new_ids), "counts do not match new_ids")
        self._grow(max(rows) + 1, 0)
        need(all(k <= self.lens[r] for r, k in zip(rows, keep)), "keep blocks a row does not hold")
        self._grow(0, max(k + n for k, n in zip(keep, num_new)))
        start = 0
        for r, k, n in zip(rows, keep, num_new):
            if k < self.lens[r]:  # a row given to another sequence, or cut: its old blocks go
                self.table[r, k:self.lens[r]] = 0
            if n:
                self.table[r, k:k + n] = c.new_ids[start:start + n]
                start += n
            self.lens[r] = k + n
        return self.table[c.rows, :max(self.lens[r] for r in rows)]                      # [B, longest]

    def _grow(self, rows: int, width: int) -> None:
        r, w = self.table.shape
        if rows <= r and width <= w:
            return
        table = np.zeros((max(rows, 2 * r) if rows > r else r, max(width, 2 * w) if width > w else w), dtype=np.int32)
        table[:r, :w] = self.table
        self.table = table
        self.lens += [0] * (len(table) - r)
