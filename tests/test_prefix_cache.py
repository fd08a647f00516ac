"""Automatic prefix caching on tiny configs (exact block ids, vLLM tests/v1/core style), then end to end."""
import pytest

from pipellm import LLM, SamplingParams
from pipellm.config import EngineConfig, SpeculativeConfig
from pipellm.engine.block_manager import BlockManager, hash_block
from pipellm.engine.engine import _SEED_STRIDE
from pipellm.engine.scheduler import Scheduler
from pipellm.engine.sequence import Request
from tests.conftest import FP32, hf_greedy_ids

BS = 4  # block size of the unit tests


def _req(rid: str, tokens: list[int], max_tokens: int = 4) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens), 0, max_tokens)


def _admit(bm: BlockManager, req: Request) -> list[int]:
    """What the scheduler does on admission, a kept partial block included; returns the cached full blocks taken."""
    cached = bm.cached_prefix(req)
    partial = bm.cached_partial(req, cached)
    n = req.num_tokens - len(cached) * BS - (partial[1] if partial else 0)
    assert bm.can_allocate(req, n, cached, partial)
    bm.allocate(req, n, cached, partial)
    return cached


def _computed(bm: BlockManager, req: Request) -> None:
    """Admits req and marks its whole prompt computed, as after its batch came back."""
    _admit(bm, req)
    req.num_computed_tokens = req.num_tokens


def _return_tokens(batch, token: int = 7) -> None:
    for req in batch.requests:
        req.in_flight = False
    for req in batch.sampled:
        req.output_token_ids.append(token)


def test_second_request_reuses_the_prefix_blocks():
    sched = Scheduler(BlockManager(16, BS), max_num_seqs=8, max_num_batched_tokens=64)
    bm = sched.block_manager
    a = _req("a", range(1, 11))                      # 2 full blocks + 2 tokens
    sched.add(a)
    first = sched.schedule()
    assert a.block_ids == [0, 1, 2] and sorted(bm.cached.values()) == [0, 1]  # its full blocks, as it is sent
    _return_tokens(first)
    b = _req("b", list(range(1, 9)) + [50, 51, 52])  # same first 2 blocks
    sched.add(b)
    assert bm.cached_prefix(b) == [0, 1]
    second = sched.schedule()
    assert second.requests == [a, b] and second.num_new_tokens == [1, 3]
    assert b.block_ids == [0, 1, 3] and bm.ref_counts[:4] == [2, 2, 1, 1]
    # b starts at num_computed_tokens == 2 * BS: only its last 3 tokens run, into its own block 3.
    assert second.stage_batch.positions.tolist() == [10, 8, 9, 10]
    assert second.stage_batch.slot_mapping.tolist() == [2 * BS + 2, 3 * BS, 3 * BS + 1, 3 * BS + 2]
    assert second.stage_batch.seq_lens.tolist() == [11, 11]
    assert (bm.num_prefix_queries, bm.num_prefix_hits) == (10 + 11, 2 * BS)
    assert bm.prefix_hit_rate == 8 / 21


def test_a_prompt_takes_the_blocks_of_a_batch_still_out():
    """With several batches in flight (several stages), the next batch is built while the one before is still in the
    pipeline. Every stage runs batches in the order they were sent, so a prompt in the next batch may take the full
    blocks that batch is writing: it runs only its own tokens."""
    sched = Scheduler(BlockManager(16, BS), max_num_seqs=8, max_num_batched_tokens=64)
    bm = sched.block_manager
    a = _req("a", range(1, 11))
    sched.add(a)
    first = sched.schedule()
    b = _req("b", list(range(1, 9)) + [50, 51, 52])
    sched.add(b)
    second = sched.schedule()                        # a is still out
    assert first.requests == [a] and a.in_flight and second.requests == [b]
    assert b.block_ids[:2] == a.block_ids[:2] and bm.num_prefix_hits == 2 * BS
    assert second.stage_batch.positions.tolist() == [8, 9, 10]


def test_admission_sets_num_computed_tokens_to_the_cached_length():
    bm, a = BlockManager(8, BS), _req("a", range(1, 11))
    _computed(bm, a)
    bm.allocate(a, 1)  # a's next step (no new block needed) registers its computed full blocks
    b = _req("b", list(range(1, 9)) + [60])
    assert _admit(bm, b) == [0, 1]
    assert b.num_computed_tokens == 2 * BS and b.block_ids == [0, 1, 3]


def test_hashes_are_chained():
    bm = BlockManager(8, BS)
    a = _req("a", range(1, 11))
    _computed(bm, a)
    bm.free(a)  # registers a's computed full blocks 0 and 1
    # Block 2 of this prompt has the same tokens as a's block 1, after a different first block: no hit.
    assert bm.cached_prefix(_req("c", [90, 91, 92, 93, 5, 6, 7, 8, 9])) == []
    # Same first block, different second: only the first hits.
    assert bm.cached_prefix(_req("d", [1, 2, 3, 4, 60, 61, 62, 63, 9])) == [0]
    assert bm.cached_prefix(_req("e", range(1, 10))) == [0, 1]


def test_fully_cached_prompt_recomputes_its_last_block():
    bm = BlockManager(8, BS)
    a = _req("a", range(1, 13))  # 3 full blocks
    _computed(bm, a)
    bm.free(a)
    same = _req("same", range(1, 13))
    # The last token must run for logits and may not be written into a shared block: the last block is redone.
    assert _admit(bm, same) == [0, 1]
    assert same.num_computed_tokens == 2 * BS and same.block_ids == [0, 1, 3]
    longer = _req("longer", range(1, 14))  # one token past the cached blocks: all three are reused
    assert _admit(bm, longer) == [0, 1, 2] and longer.num_computed_tokens == 3 * BS
    assert longer.block_ids == [0, 1, 2, 4]
    assert bm.num_prefix_hits == 2 * BS + 3 * BS


def test_shared_block_stays_allocated_until_both_finish():
    bm = BlockManager(6, BS)
    a = _req("a", range(1, 10))
    _computed(bm, a)
    bm.allocate(a, 1)  # a's next step registers its computed full blocks
    b = _req("b", range(1, 10))
    assert _admit(bm, b) == [0, 1] and b.block_ids == [0, 1, 3]
    assert bm.num_free_blocks == 2 and bm.usage == pytest.approx(4 / 6)
    bm.free(a)
    assert bm.ref_counts[:4] == [1, 1, 0, 1] and bm.num_free_blocks == 3 and 0 not in bm.evictable
    b.num_computed_tokens = 9
    bm.free(b)
    assert bm.ref_counts == [0] * 6 and bm.num_free_blocks == 6 and bm.usage == 0.0
    assert bm.cached_prefix(_req("c", range(1, 10))) == [0, 1]  # unreferenced, still cached


def test_eviction_prefers_empty_blocks_then_least_recently_freed():
    bm = BlockManager(6, BS)
    x, y = _req("x", range(1, 9)), _req("y", range(11, 19))
    _computed(bm, x)
    _computed(bm, y)
    assert x.block_ids == [0, 1] and y.block_ids == [2, 3]
    bm.free(x)
    bm.free(y)
    # Each request's blocks queue tail first; x was freed before y.
    assert list(bm.evictable) == [1, 0, 3, 2] and list(bm.free_ids) == [4, 5]
    z = _req("z", range(100, 112))
    assert _admit(bm, z) == [] and z.block_ids == [4, 5, 1]  # empty blocks first, then x's tail
    assert bm.cached_prefix(_req("x2", range(1, 10))) == [0]  # x's head is still there
    w = _req("w", range(200, 208))
    _admit(bm, w)
    assert w.block_ids == [0, 3]
    assert bm.cached_prefix(_req("x3", range(1, 10))) == [] and bm.cached_prefix(_req("y2", range(11, 20))) == [2]
    assert not bm.can_allocate(_req("v", range(300, 309)), 9)  # 1 free block left, 3 needed


def test_reviving_a_free_cached_block_counts_against_free_space():
    bm = BlockManager(3, BS)
    a = _req("a", range(1, 9))
    _computed(bm, a)
    bm.free(a)
    b = _req("b", range(1, 14))  # would take cached blocks 0 and 1 (both unreferenced) and need 2 more
    cached = bm.cached_prefix(b)
    assert cached == [0, 1] and bm.num_free_blocks == 3
    assert not bm.can_allocate(b, 5, cached)
    assert bm.can_allocate(b, 4, cached)


def test_caching_off_never_hits():
    bm = BlockManager(8, BS, enable_caching=False)
    a = _req("a", range(1, 10))
    _computed(bm, a)
    bm.free(a)
    b = _req("b", range(1, 10))
    assert _admit(bm, b) == [] and b.num_computed_tokens == 0 and b.block_ids == [3, 4, 5]
    assert bm.cached == {} and bm.prefix_hit_rate == 0.0
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        EngineConfig("model", enable_prefix_caching="yes")


def test_a_run_ahead_token_is_not_indexed_before_it_is_known():
    """Async scheduling sends a request's next decode while the batch that samples its input is out. The block that
    input completes is not indexed under a placeholder, where a sibling (n=2) that drew another token there would
    find it and read the other token's K/V (found by benchmarks/parity_fuzz.py, seed 13130)."""
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = _req("a", range(1, 4))  # 3 prompt tokens: the first token sampled completes block 0
    _admit(bm, a)  # batch N runs the prompt and samples token 3
    a.num_computed_tokens, a.in_flight = 3, 1
    bm.allocate_ahead(a, 1)  # batch N + 1 runs position 3, fed N's sample, as the scheduler sends it
    a.num_ahead, a.num_computed_tokens, a.in_flight = 1, 4, 2
    bm.cache_sent_blocks(a)
    assert bm.cached == {}
    a.num_ahead, a.in_flight = 0, 1  # N is back with token 9
    a.output_token_ids.append(9)
    bm.cache_sent_blocks(a)
    assert bm.cached == {hash_block(b"", [1, 2, 3, 9]): a.block_ids[0]}


def test_no_leaks_after_preempt_finish_and_abort():
    bm = BlockManager(num_blocks=3, block_size=BS)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    a, b = _req("a", range(1, 9)), _req("b", range(1, 9))
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    # admitted together: b takes the full block that a writes in the same batch (each layer writes the batch's K/V
    # before it attends), and computes its last block, which must run to give logits, in a block of its own
    assert a.block_ids == [0, 1] and b.block_ids == [0, 2] and bm.ref_counts == [2, 1, 1]
    assert batch.num_new_tokens == [8, 4]
    _return_tokens(batch)
    # "a" needs a third block: "b" is preempted, and its copy of a's second block freed for it
    batch = sched.schedule()
    assert batch.requests == [a] and batch.num_new_tokens == [1] and b.num_preemptions == 1
    assert a.block_ids == [0, 1, 2] and b.block_ids == [] and bm.ref_counts == [1, 1, 1]
    _return_tokens(batch)
    sched.finish(a, "length")
    assert bm.ref_counts == [0, 0, 0] and bm.num_free_blocks == 3
    # b comes back on a's two cached blocks and recomputes only its last token
    batch = sched.schedule()
    assert batch.requests == [b] and batch.num_new_tokens == [1] and b.block_ids == [0, 1, 2]
    # Aborted while its batch is out: its blocks are kept until the batch returns, then freed.
    sched.finish(b, "abort")
    assert bm.num_free_blocks == 0
    for req in batch.requests:
        req.in_flight = False
        bm.free(req)
    assert bm.num_free_blocks == 3 and bm.ref_counts == [0] * 3 and bm.usage == 0.0
    assert sched.num_unfinished == 0
    assert bm.cached_prefix(_req("c", range(1, 10))) == [0, 1]  # the prompt's blocks stay cached, free


def test_a_prompt_with_drafts_after_it_shares_the_blocks_it_writes():
    """A prompt's last chunk may get n-gram drafts in the same batch; the full blocks the chunk writes are indexed
    as the batch is built, and a second prompt admitted into it takes them."""
    bm = BlockManager(num_blocks=8, block_size=BS)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64,
                      speculative_config=SpeculativeConfig(3, prompt_lookup_min=1, prompt_lookup_max=3))
    a, b = _req("a", [1, 2, 3, 1, 2, 3, 1, 2], max_tokens=8), _req("b", [1, 2, 3, 1, 2, 3, 1, 2, 9])
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    assert a.draft_token_ids == [3, 1, 2] and batch.num_new_tokens == [11, 1]
    assert a.block_ids == [0, 1, 3] and b.block_ids == [0, 1, 2] and bm.ref_counts[:4] == [2, 2, 1, 1]


def test_a_request_going_on_from_an_ended_one_takes_over_or_copies_its_partial_block():
    bm = BlockManager(num_blocks=6, block_size=BS, reuse_partial=True)
    a = _req("a", range(1, 7))  # 6 tokens: block 0 full, block 1 holds 2
    _computed(bm, a)
    bm.free(a)
    assert list(bm.evictable) == [1, 0] and bm.num_free_blocks == 6
    # b goes on from a's 6 tokens: it takes a's partial block over, and runs only its last token, into slot 2
    b = _req("b", [*range(1, 7), 50])
    assert bm.cached_partial(b, bm.cached_prefix(b)) == (1, 2)
    assert _admit(bm, b) == [0]
    assert b.block_ids == [0, 1] and b.num_computed_tokens == 6 and bm.pending_copies == []
    assert bm.num_free_blocks == 4
    # c goes on from the same tokens while b holds the block: a new block, copied from it before c's batch runs
    c = _req("c", [*range(1, 7), 60])
    assert bm.cached_partial(c, bm.cached_prefix(c)) == (1, 2)
    assert _admit(bm, c) == [0]
    assert c.block_ids == [0, 2] and c.num_computed_tokens == 6 and bm.pending_copies == [(1, 2)]
    # a shorter run of the same start matches too; the same tokens after another block 0 do not
    d, e = _req("d", [*range(1, 6), 70]), _req("e", [9, 2, 3, 4, 5, 6, 7])
    assert bm.cached_partial(d, bm.cached_prefix(d)) == (1, 1)
    assert bm.cached_prefix(e) == [] and bm.cached_partial(e, []) is None
    # b wrote its token after the two: freed, the block starts with three known tokens
    b.num_computed_tokens = 7
    bm.free(b)
    f = _req("f", [*range(1, 7), 50, 51])
    assert bm.cached_partial(f, bm.cached_prefix(f)) == (1, 3)


def test_a_kept_partial_block_is_forgotten_when_evicted_or_written_over():
    bm = BlockManager(num_blocks=3, block_size=BS, reuse_partial=True)
    a = _req("a", range(1, 8))  # block 1 holds 3 tokens
    _computed(bm, a)
    bm.free(a)
    # taken over after its first 2 tokens: the third is written over, so the 3-token start is gone
    b = _req("b", [1, 2, 3, 4, 5, 6, 99, 100])
    assert bm.cached_partial(b, bm.cached_prefix(b)) == (1, 2)
    assert _admit(bm, b) == [0] and b.block_ids == [0, 1] and b.num_computed_tokens == 6
    x = _req("x", range(1, 9))
    assert bm.cached_partial(x, bm.cached_prefix(x)) == (1, 2)
    # evicted for another prompt: nothing of it is found any more
    bm.free(b)
    _computed(bm, _req("g", range(200, 212)))  # 3 blocks: every block evicted
    assert bm.partial == {} and bm.partial_keys == {}
    y = _req("y", range(1, 9))
    assert bm.cached_partial(y, bm.cached_prefix(y)) is None
    # off (caching off, or int8 caches, whose blocks re-round as they fill): never kept
    off = BlockManager(num_blocks=3, block_size=BS, reuse_partial=False)
    a = _req("a", range(1, 8))
    _computed(off, a)
    off.free(a)
    assert off.partial == {} and off.cached_partial(_req("b", range(1, 9)), off.cached_prefix(a)) is None


@pytest.mark.parametrize("pp", [1, 2])
def test_kept_partial_blocks_keep_greedy_output(llama_dir, checkpoints, pp):
    """A 40-token prompt leaves 8 tokens in its third block of 16; three requests go on from them: the first takes
    the block over, the others get copies on every stage. Each runs only its tokens past the 40."""
    prompt = [(7 * i) % 300 + 1 for i in range(40)]
    goes_on = [prompt + [5], prompt + [9], prompt + [5, 77]]
    expected = hf_greedy_ids(checkpoints["llama"][1], goes_on, GREEDY.max_tokens)
    with LLM(llama_dir, pipeline_parallel_size=pp, dtype=FP32) as llm:
        llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1), use_tqdm=False)
        bm = llm.engine.block_manager
        hits = bm.num_prefix_hits
        outs = llm.generate([{"prompt_token_ids": p} for p in goes_on], GREEDY, use_tqdm=False)
        assert bm.num_prefix_hits - hits == 3 * 40
        assert bm.num_free_blocks == llm.engine.num_blocks
    assert _token_ids(outs) == expected


# ---- end to end: tiny random Llama, 2 stages ----------------------------------------------------------------

SYSTEM = [(7 * i) % 300 + 1 for i in range(40)]  # a 40-token system prompt: 2 full blocks of 16, plus 8
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _prompts() -> list[dict]:
    prompts = [{"prompt_token_ids": SYSTEM + [(11 * i + j) % 300 + 1 for j in range(1 + (5 * i) % 37)]}
               for i in range(22)]
    prompts.append({"prompt_token_ids": SYSTEM + [5] * 8})  # exactly 3 blocks; the same prompt twice
    prompts.append({"prompt_token_ids": SYSTEM + [5] * 8})
    return prompts


def _token_ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_prefix_caching_keeps_greedy_output(llama_dir, checkpoints):
    prompts = _prompts()
    expected = hf_greedy_ids(checkpoints["llama"][1], [p["prompt_token_ids"] for p in prompts], GREEDY.max_tokens)
    with LLM(llama_dir, pipeline_parallel_size=2, enable_prefix_caching=False, dtype=FP32) as off:
        assert _token_ids(off.generate(prompts, GREEDY, use_tqdm=False)) == expected
        assert off.engine.block_manager.num_prefix_hits == 0
    # max_num_seqs=2 admits requests over many steps, so later ones find the prefix computed by earlier ones.
    with LLM(llama_dir, pipeline_parallel_size=2, max_num_seqs=2, dtype=FP32) as on:
        assert _token_ids(on.generate(prompts, GREEDY, use_tqdm=False)) == expected
        bm = on.engine.block_manager
        assert bm.num_prefix_queries == sum(len(p["prompt_token_ids"]) for p in prompts)
        # The first request computes the prefix; each of the other 23 takes its 2 full blocks of 16 (the second,
        # admitted into the same batch, those the first writes there).
        assert bm.num_prefix_hits == 23 * 32 and bm.prefix_hit_rate == 736 / bm.num_prefix_queries
        assert bm.num_free_blocks == on.engine.num_blocks and bm.usage == 0.0
    # 64 tokens a batch: every prompt after the first takes the blocks the first writes, in the same batch or in a
    # later one while that batch is still out
    with LLM(llama_dir, pipeline_parallel_size=2, max_num_batched_tokens=64, dtype=FP32) as small:
        assert _token_ids(small.generate(prompts, GREEDY, use_tqdm=False)) == expected
        assert small.engine.block_manager.num_prefix_hits == 23 * 32


def test_a_requests_completions_share_its_prompt_in_one_batch(llama_dir, checkpoints, llm_pp2):
    """n=3: the completions are admitted into one batch, and the second and third take the full blocks the first
    writes there (each layer writes the batch's K/V before any attention reads it); they compute only the last
    block. Greedy, each equals HF's; seeded, each equals a request of its own seed in an engine without the cache."""
    prompt = {"prompt_token_ids": [(17 * i) % 300 + 3 for i in range(40)]}
    bm = llm_pp2.engine.block_manager
    hits = bm.num_prefix_hits
    greedy = llm_pp2.generate(prompt, SamplingParams(n=3, max_tokens=8, temperature=0.0, ignore_eos=True),
                              use_tqdm=False)[0].outputs
    assert bm.num_prefix_hits - hits == 2 * 32
    want = hf_greedy_ids(checkpoints["llama"][1], [prompt["prompt_token_ids"]], 8)[0]
    assert [c.token_ids for c in greedy] == [want] * 3
    seeded = SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=11, ignore_eos=True)
    drawn = llm_pp2.generate({"prompt_token_ids": [t + 1 for t in prompt["prompt_token_ids"]]}, seeded,
                             use_tqdm=False)[0].outputs
    with LLM(llama_dir, pipeline_parallel_size=2, enable_prefix_caching=False, dtype=FP32) as off:
        alone = [off.generate({"prompt_token_ids": [t + 1 for t in prompt["prompt_token_ids"]]},
                              SamplingParams(max_tokens=8, temperature=1.0, seed=(11 + i * _SEED_STRIDE) % 2 ** 63,
                                             ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
                 for i in range(3)]
    assert [c.token_ids for c in drawn] == alone and len(set(map(tuple, alone))) > 1


def test_same_prompt_twice_hits_the_cache(llm_pp2):
    bm = llm_pp2.engine.block_manager
    prompt = {"prompt_token_ids": [(13 * i) % 300 + 50 for i in range(40)]}
    queries, hits = bm.num_prefix_queries, bm.num_prefix_hits
    first = _token_ids(llm_pp2.generate(prompt, GREEDY, use_tqdm=False))
    assert (bm.num_prefix_queries - queries, bm.num_prefix_hits - hits) == (40, 0)
    second = _token_ids(llm_pp2.generate(prompt, GREEDY, use_tqdm=False))
    assert second == first
    assert (bm.num_prefix_queries - queries, bm.num_prefix_hits - hits) == (80, 32)  # 2 full blocks of 16
    assert bm.num_free_blocks == llm_pp2.engine.num_blocks


def test_a_reset_prefix_cache_runs_the_next_prompt_cold(llm_pp2):
    """vLLM's LLM.reset_prefix_cache: the same prompt again finds nothing, and gives the same tokens; refused while
    a request runs."""
    bm = llm_pp2.engine.block_manager
    prompt = {"prompt_token_ids": [(17 * i) % 300 + 40 for i in range(40)]}
    first = _token_ids(llm_pp2.generate(prompt, GREEDY, use_tqdm=False))
    assert llm_pp2.reset_prefix_cache()
    hits = bm.num_prefix_hits
    assert _token_ids(llm_pp2.generate(prompt, GREEDY, use_tqdm=False)) == first and bm.num_prefix_hits == hits
    llm_pp2.engine.add_request("running", prompt["prompt_token_ids"], GREEDY)
    assert not llm_pp2.reset_prefix_cache()
    while llm_pp2.engine.has_unfinished_requests():
        llm_pp2.engine.step()
    assert llm_pp2.engine.pop_output("running", None).finished  # (the shared engine left as it was)
    assert bm.num_prefix_hits == hits + 32 and llm_pp2.reset_prefix_cache()
