"""Bytes of a decode step's StageBatch on the wire with block-table changes against whole block tables, and what a
stage spends rebuilding the tables from the changes. Scheduler and StageBlockTables only, no model.

    python benchmarks/stage_batch_bytes.py
"""
import dataclasses
import timeit

from pipellm import SamplingParams
from pipellm.engine.block_manager import BlockManager
from pipellm.engine.scheduler import Scheduler
from pipellm.engine.sequence import Request
from pipellm.pipeline import wire
from pipellm.pipeline.block_tables import StageBlockTables

BLOCK = 16


def main() -> None:
    for seqs, context in ((1, 100), (32, 192), (8, 4096)):
        bm = BlockManager(num_blocks=seqs * (context // BLOCK + 4), block_size=BLOCK, enable_caching=False)
        sched = Scheduler(bm, max_num_seqs=256, max_num_batched_tokens=10 ** 6)
        for i in range(seqs):
            sched.add(Request(str(i), list(range(1, context + 1)), SamplingParams(max_tokens=8), 0, 8))
        stage = StageBlockTables()
        prefill = sched.schedule()
        stage.apply(prefill.stage_batch.table_changes, seqs, prefill.batch_id)
        for r in prefill.requests:  # its tokens are back
            r.in_flight -= 1
            r.output_token_ids.append(5)
        decode = sched.schedule().stage_batch
        whole = dataclasses.replace(decode, table_changes=None,
                                    block_tables=stage.apply(decode.table_changes, seqs, decode.batch_id))
        apply_us = min(timeit.repeat(lambda: stage.apply(decode.table_changes, seqs, decode.batch_id),
                                     number=200, repeat=5)) / 200 * 1e6
        print(f"{seqs} x {context} tokens: a decode step's StageBatch {len(wire.encode(decode))} bytes with "
              f"block-table changes, {len(wire.encode(whole))} with whole tables; rebuilding the tables "
              f"{apply_us:.1f} us")


if __name__ == "__main__":
    main()
