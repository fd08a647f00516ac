"""BlockManager and Scheduler on tiny configs: exact block ids, chunked prefill, preemption, no leaks."""
from collections import deque

import pytest

from pipellm import LLM, SamplingParams
from pipellm.config import EngineConfig
from pipellm.engine.block_manager import BlockManager
from pipellm.engine.scheduler import Scheduler
from pipellm.engine.sequence import Request, RequestStatus
from pipellm.pipeline.block_tables import StageBlockTables
from pipellm.pipeline.messages import AHEAD_TOKEN
from tests.conftest import FP32, hf_greedy_ids, spy_chunks_ahead


def _req(rid: str, num_prompt: int, max_tokens: int = 4) -> Request:
    return Request(rid, list(range(1, num_prompt + 1)), SamplingParams(max_tokens=max_tokens), 0, max_tokens)


def _return_tokens(batch, token: int = 7) -> None:
    """What the engine does when a batch's tokens come back."""
    for req in batch.requests:
        req.in_flight -= 1
    for req in batch.sampled:
        req.num_ahead = 0
        req.output_token_ids.append(token)


def test_block_ids_are_handed_out_and_returned():
    bm = BlockManager(num_blocks=6, block_size=4, enable_caching=False)  # plain allocation (caching: test_prefix_cache)
    a, b = _req("a", 9), _req("b", 3)
    assert bm.num_blocks_needed(a, 9) == 3
    bm.allocate(a, 9)
    bm.allocate(b, 3)
    assert a.block_ids == [0, 1, 2] and b.block_ids == [3]
    a.num_computed_tokens = 9
    assert bm.num_blocks_needed(a, 3) == 0  # 12 tokens still fit in 3 blocks
    assert bm.num_blocks_needed(a, 4) == 1
    assert not bm.can_allocate(_req("c", 9), 9)
    bm.free(a)
    assert a.block_ids == [] and bm.num_free_blocks == 5
    c = _req("c", 13)
    bm.allocate(c, 13)
    assert c.block_ids == [4, 5, 0, 1]  # never-used blocks first, then freed ones in order
    assert bm.usage == 5 / 6


def test_sliding_window_layers_cycle_through_a_ring_of_blocks():
    # rings of 3 blocks: the window layers of a growing sequence reuse their oldest block in place
    bm = BlockManager(num_blocks=12, block_size=4, enable_caching=False, num_window_blocks=5, window_ring=3)
    a = _req("a", 6, max_tokens=16)
    bm.allocate(a, 6)
    assert a.block_ids == [0, 1] and a.window_block_ids == [0, 1]
    a.num_computed_tokens = 6
    bm.allocate(a, 10)                                   # 16 tokens: 4 blocks for full layers, the ring stays at 3
    assert a.block_ids == [0, 1, 2, 3] and a.window_block_ids == [0, 1, 2]
    b, c = _req("b", 5), _req("c", 9)
    assert bm.can_allocate(b, 5) and not bm.can_allocate(c, 9)  # c's ring needs 3 window blocks, 2 are left
    bm.allocate(b, 5)
    assert b.window_block_ids == [3, 4]
    bm.free(a)
    assert a.window_block_ids == [] and bm.can_allocate(c, 9)
    bm.allocate(c, 9)
    assert c.block_ids == [6, 7, 8] and c.window_block_ids == [0, 1, 2]


def test_chunked_prefill_and_mixed_steps():
    sched = Scheduler(BlockManager(32, 4), max_num_seqs=8, max_num_batched_tokens=8)
    long, short = _req("long", 20), _req("short", 3)
    sched.add(long)
    first = sched.schedule()
    assert first.num_new_tokens == [8] and first.sampled == []  # a chunk, no token sampled yet
    assert first.stage_batch.positions.tolist() == list(range(8))
    assert first.stage_batch.slot_mapping.tolist() == list(range(8))
    assert sched.schedule() is None  # "long" is in flight: not scheduled again until it is back
    _return_tokens(first)
    sched.add(short)
    second = sched.schedule()
    assert [r.request_id for r in second.requests] == ["long"] and second.num_new_tokens == [8]
    _return_tokens(second)
    third = sched.schedule()
    # The last 4 prompt tokens of "long" and the whole of "short" share one step.
    assert [r.request_id for r in third.requests] == ["long", "short"] and third.num_new_tokens == [4, 3]
    assert third.sampled == [long, short]
    assert third.stage_batch.logits_indices.tolist() == [3, 6]
    assert third.stage_batch.positions.tolist() == [16, 17, 18, 19, 0, 1, 2]
    assert third.stage_batch.seq_lens.tolist() == [20, 3]
    _return_tokens(third)
    decode = sched.schedule()
    assert decode.num_new_tokens == [1, 1] and decode.stage_batch.positions.tolist() == [20, 3]
    assert decode.stage_batch.input_ids.tolist() == [7, 7]


def test_max_num_seqs_bounds_the_requests_of_every_batch_in_flight_together():
    sched = Scheduler(BlockManager(32, 4), max_num_seqs=2, max_num_batched_tokens=64)
    for name in "abc":
        sched.add(_req(name, 3))
    # two batches in flight, as the engine fills a 2-stage pipeline: one decode each, prompts by the token budget
    first = sched.schedule(max_num_seqs=1)
    assert [r.request_id for r in first.requests] == ["a", "b"]
    assert sched.schedule(max_num_seqs=1) is None and [r.request_id for r in sched.waiting] == ["c"]
    _return_tokens(first)
    second, third = sched.schedule(max_num_seqs=1), sched.schedule(max_num_seqs=1)
    assert [r.request_id for r in second.requests + third.requests] == ["a", "b"]
    assert second.num_new_tokens == third.num_new_tokens == [1]
    _return_tokens(second)
    sched.finish(second.requests[0], "stop")
    assert [r.request_id for r in sched.schedule().requests] == ["c"]  # a running request ended: room for one


def test_preemption_frees_blocks_and_recomputes_later():
    # Caching off: "a" and "b" have the same prompt, so with it on, block ids change as they share blocks
    # (test_prefix_cache.py::test_no_leaks_after_preempt_finish_and_abort runs this with caching on).
    bm = BlockManager(num_blocks=4, block_size=4, enable_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    a, b = _req("a", 8), _req("b", 8)
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    assert a.block_ids == [0, 1] and b.block_ids == [2, 3] and bm.num_free_blocks == 0
    _return_tokens(batch)
    # Both now hold 9 tokens: "a" needs a third block; "b" (scheduled later) is preempted to make room.
    batch = sched.schedule()
    assert batch.requests == [a] and a.block_ids == [0, 1, 2]
    assert b.num_computed_tokens == 0 and b.block_ids == [] and b.num_preemptions == 1
    assert list(sched.waiting) == [b] and b.output_token_ids == [7]  # keeps its tokens for the recompute
    _return_tokens(batch)
    sched.finish(a, "length")
    assert bm.num_free_blocks == 4 and sched.finished_ids == ["a"]
    batch = sched.schedule()
    assert batch.requests == [b] and batch.num_new_tokens == [9]  # prompt + its output, recomputed
    assert batch.stage_batch.finished_req_ids == ["a"]


def test_priority_policy_admits_and_preempts_in_priority_order():
    sched = Scheduler(BlockManager(32, 4), max_num_seqs=1, max_num_batched_tokens=64, by_priority=True)
    reqs = {name: _req(name, 3) for name in "abcd"}
    for name, priority in zip("abcd", (2, 0, 1, 0)):
        reqs[name].priority = priority
        sched.add(reqs[name])
    order = []
    while sched.num_unfinished:
        batch = sched.schedule()
        order.append(batch.requests[0].request_id)
        _return_tokens(batch)
        sched.finish(batch.requests[0], "stop")
    assert order == ["b", "d", "c", "a"]  # lower first; equal ones in arrival order

    # both need a third block: the one of lower priority (a higher number) is preempted, though admitted first
    for by_priority, preempted in ((False, "b"), (True, "a")):
        sched = Scheduler(BlockManager(4, 4, enable_caching=False), max_num_seqs=8, max_num_batched_tokens=64,
                          by_priority=by_priority)
        a, b = _req("a", 8), _req("b", 8)
        a.priority, b.priority = 1, 0
        sched.add(a)
        sched.add(b)
        assert sched.schedule().requests == ([a, b] if not by_priority else [b, a])
        for r in (a, b):
            r.in_flight, r.output_token_ids = 0, [7]
        batch = sched.schedule()
        assert [r.request_id for r in sched.waiting] == [preempted]
        assert [r.request_id for r in batch.requests] == [{"a": "b", "b": "a"}[preempted]]


@pytest.mark.parametrize("ahead", ["none", "run_ahead", "chunks_ahead"])
def test_a_stage_rebuilds_every_block_table_from_the_changes_alone(ahead):
    """Each batch sends only the block ids its requests' rows gained. Through growth, preemption, prefix hits, rows
    reused after a request finishes, async scheduling's batches ahead and prompt chunks sent while the chunk before
    is out, a stage's tables built from the changes equal the requests' own block ids, batch after batch."""
    bm = BlockManager(num_blocks=8, block_size=4, enable_caching=True)  # tight: requests are preempted
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=12, run_ahead_max_seqs=8 * (ahead == "run_ahead"),
                      chunks_ahead=ahead == "chunks_ahead")
    stage = StageBlockTables()
    for rid, prompt in [("a", 9), ("b", 5), ("c", 9), ("d", 3), ("e", 9)]:  # c's and e's prompts are a's: prefix hits
        sched.add(_req(rid, prompt, max_tokens=8))
    sent = held = chunks_ahead = 0
    in_flight = deque()
    while sched.num_unfinished or in_flight:
        batch = sched.schedule()
        if batch is not None:
            chunks_ahead += any(r.in_flight == 2 and not r.num_ahead for r in batch.requests)
            expected = [list(r.block_ids) for r in batch.requests]
            changes = batch.stage_batch.table_changes
            tables = stage.apply(changes, len(expected), batch.batch_id)
            assert tables.tolist() == [e + [0] * (tables.shape[1] - len(e)) for e in expected]
            sent, held = sent + len(changes.new_ids), held + sum(map(len, expected))
            in_flight.append(batch)
        if batch is None or len(in_flight) == 2 or ahead == "none":
            done = in_flight.popleft()
            _return_tokens(done)
            for r in done.requests:
                if len(r.output_token_ids) >= r.max_tokens and r.status != RequestStatus.FINISHED:
                    sched.finish(r, "length")
                elif r.status == RequestStatus.FINISHED and not r.in_flight:
                    bm.free(r)  # as the engine does once a stopped request's batches are back
    assert sched.num_preemptions > 0 and bm.num_prefix_hits > 0 and bm.num_rows < 8
    assert sent < held / 3  # decode steps send no block ids but a new block's
    assert (chunks_ahead > 0) == (ahead == "chunks_ahead")


def test_a_prompt_aborted_with_a_chunk_out_frees_its_blocks_once_it_is_back(llama_dir, checkpoints):
    with LLM(llama_dir, pipeline_parallel_size=2, dtype=FP32, max_num_batched_tokens=16) as llm:
        engine = llm.engine
        prompt = [(3 * i) % 300 + 1 for i in range(100)]
        engine.add_request("x", prompt, SamplingParams(max_tokens=5))
        engine.step()  # two chunks sent, the second while the first was out; the first is back
        req = engine.requests[engine.groups["x"][0]]
        assert req.in_flight == 1 and req.num_computed_tokens == 32
        engine.abort_request("x")
        assert engine.block_manager.num_free_blocks < engine.num_blocks  # the chunk out still writes its blocks
        engine.step(fill=False)
        assert not engine.in_flight and engine.block_manager.num_free_blocks == engine.num_blocks
        # its two blocks stay in the prefix cache, with the K/V both chunks wrote: a prompt starting as it equals HF
        second = prompt[:40] + [7, 8, 9]
        expected = hf_greedy_ids(checkpoints["llama"][1], [second], 8)
        out = llm.generate({"prompt_token_ids": second}, SamplingParams(max_tokens=8, temperature=0.0,
                                                                         ignore_eos=True), use_tqdm=False)
        assert engine.block_manager.num_prefix_hits == 32
    assert out[0].outputs[0].token_ids == expected[0]


def test_finished_and_aborted_requests_free_every_block(llama_dir):
    with LLM(llama_dir, pipeline_parallel_size=2) as llm:
        engine = llm.engine
        engine.add_request("x", [1, 2, 3, 4, 5], SamplingParams(max_tokens=50, ignore_eos=True))
        engine.step()
        engine.step()
        assert engine.block_manager.num_free_blocks < engine.num_blocks
        engine.abort_request("x")
        assert not engine.has_unfinished_requests()
        assert engine.block_manager.num_free_blocks == engine.num_blocks
        llm.generate([{"prompt_token_ids": [i + 1] * 30} for i in range(8)], SamplingParams(max_tokens=5),
                     use_tqdm=False)
        assert engine.block_manager.num_free_blocks == engine.num_blocks


def test_request_ids_are_unique_and_every_completion_is_found_by_its_request_id(llm_pp2):
    engine = llm_pp2.engine
    engine.add_request("a", [1, 2, 3], SamplingParams(n=2, max_tokens=3, ignore_eos=True))
    engine.add_request("a-0x", [1, 2, 3], SamplingParams(max_tokens=3))
    for taken, n in [("a", 1), ("a", 2), ("a-0", 1), ("a-1", 1), ("a-0x", 2)]:
        with pytest.raises(ValueError, match="already in use"):
            engine.add_request(taken, [4], SamplingParams(n=n))
    engine.abort_request("a-0x")
    assert sorted(engine.requests) == ["a-0", "a-1"]
    while engine.has_unfinished_requests():
        engine.step()
    out = engine.pop_output("a", None)
    assert [len(c.token_ids) for c in out.outputs] == [3, 3] and out.finished
    assert not engine.requests and not engine.groups
    assert engine.block_manager.num_free_blocks == engine.num_blocks


def test_priority_scheduling_orders_requests_and_keeps_their_output(llama_dir, checkpoints, llm_pp2):
    prompts = [{"prompt_token_ids": [(i * 7 + j) % 300 + 1 for j in range(10 + 3 * i)]} for i in range(3)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    with LLM(llama_dir, dtype=FP32, max_num_seqs=1, scheduling_policy="priority") as llm:
        outs = llm.generate(prompts, params, use_tqdm=False, priority=[2, -1, 0])
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy_ids(checkpoints["llama"][1],
                                                                   [p["prompt_token_ids"] for p in prompts], 6)
    finished = sorted(range(3), key=lambda i: outs[i].metrics.token_times[-1])
    assert finished == [1, 2, 0]
    with pytest.raises(ValueError, match=r'priority=1: this engine runs requests first come, first served; start it '
                                         r'with scheduling_policy="priority" \(--scheduling-policy priority\)'):
        llm_pp2.generate(prompts, params, priority=[0, 1, 0])
    with pytest.raises(ValueError, match=r"priority: give a list of one integer per prompt \(3\)"):
        llm_pp2.generate(prompts, params, priority=[0])
    with pytest.raises(ValueError, match='scheduling_policy=.lifo.: must be "fcfs" or "priority"'):
        EngineConfig(llama_dir, scheduling_policy="lifo")
    assert llm_pp2.generate(prompts, params, use_tqdm=False, priority=[0, 0, 0])[0].outputs[0].token_ids


@pytest.mark.parametrize("pp,steps,budget", [(2, 1, None), (1, 6, None), (2, 1, 8)])
def test_memory_pressure_preempts_without_changing_greedy_output(llama_dir, checkpoints, pp, steps, budget):
    prompts = [{"prompt_token_ids": [(i * 7 + j) % 300 + 1 for j in range(10 + 3 * i)]} for i in range(10)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    expected = hf_greedy_ids(checkpoints["llama"][1], [p["prompt_token_ids"] for p in prompts], params.max_tokens)
    # 16 blocks of 16 tokens for 10 requests needing up to 4 blocks each (and blocks for several steps ahead);
    # with a budget of 8 tokens a step, prompts go in chunks, sent while the chunk before is out
    with LLM(llama_dir, pipeline_parallel_size=pp, num_kv_blocks=16, dtype=FP32, num_scheduler_steps=steps,
             max_num_batched_tokens=budget) as tight:
        ahead = spy_chunks_ahead(tight)
        got = [o.outputs[0].token_ids for o in tight.generate(prompts, params, use_tqdm=False)]
        preempted = tight.engine.scheduler.num_preemptions
        assert tight.engine.block_manager.num_free_blocks == 16
    assert got == expected
    assert preempted > 0
    assert any(ahead) or budget is None


@pytest.mark.parametrize("pp", [2, 3])
def test_prompt_chunks_sent_ahead_match_hf_greedy(checkpoints, pp):
    """Several stages: a prompt's next chunk goes out while the one before is still in the pipeline, so a long
    prompt's chunks fill every stage. Greedy ids equal HF's, prefix-cache hits included (a prompt repeated, and one
    sharing the first's head, taking blocks whose K/V batches still out may be writing)."""
    base = [(5 * i + 3) % 300 + 1 for i in range(70)]
    prompts = [base, [(7 * i + 1) % 300 + 1 for i in range(45)], base[:40] + [9, 8, 7], base]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    expected = hf_greedy_ids(checkpoints["llama"][1], prompts, params.max_tokens)
    with LLM(checkpoints["llama"][0], pipeline_parallel_size=pp, dtype=FP32, max_num_batched_tokens=16) as llm:
        ahead = spy_chunks_ahead(llm)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        hits = llm.engine.block_manager.num_prefix_hits
        assert llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert any(ahead) and hits > 0


@pytest.fixture(scope="module")
def llm_steps(llama_dir):
    """One stage running up to 5 decode steps a batch, sampling its own next inputs."""
    with LLM(llama_dir, num_scheduler_steps=5, dtype=FP32) as llm:
        yield llm


@pytest.mark.parametrize("arch,pp", [("llama", 1), ("qwen2", 1), ("gpt2", 1), ("mistral", 1), ("llama", 3)])
def test_several_decode_steps_a_batch_match_hf_greedy(checkpoints, arch, pp):
    prompts = [[5, 6, 7], [(7 * i + 3) % 300 for i in range(19)], [(11 * i + 1) % 300 for i in range(40)]]
    params = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)  # 13 decodes: steps of 5, 5, 3
    expected = hf_greedy_ids(checkpoints[arch][1], prompts, params.max_tokens)
    with LLM(checkpoints[arch][0], pipeline_parallel_size=pp, num_scheduler_steps=5, dtype=FP32) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                               use_tqdm=False)]
        batches = llm.engine.scheduler.num_batches
        ring = llm.engine.block_manager.window_ring
        if pp > 1:  # one sequence alone takes several steps a batch through every stage
            alone = llm.generate({"prompt_token_ids": prompts[1]}, params, use_tqdm=False)[0].outputs[0].token_ids
            assert alone == expected[1] and llm.engine.scheduler.num_batches - batches == 4
    assert got == expected
    # one prefill, then three batches; sliding-window rings take one step at a time (mistral's window is 24); with
    # three stages, three batches in flight take a sequence each, one step at a time
    assert batches == ((14 if ring else 4) if pp == 1 else 14 * len(prompts))


def test_a_stop_inside_several_steps_drops_the_rest(llm_steps, checkpoints):
    prompt = [(3 * i + 2) % 300 for i in range(30)]
    full = hf_greedy_ids(checkpoints["llama"][1], [prompt], 12)[0]
    stop_at = next(i for i in range(2, 12) if full[i] not in full[:i])  # a token not generated before it
    out = llm_steps.generate({"prompt_token_ids": prompt},
                             SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[full[stop_at]]),
                             use_tqdm=False)[0].outputs[0]
    assert out.token_ids == full[:stop_at + 1] and out.finish_reason == "stop" and out.stop_reason == full[stop_at]
    engine = llm_steps.engine
    assert engine.block_manager.num_free_blocks == engine.num_blocks
    # its cached blocks hold only its own tokens: a prompt that continues it decodes as HF does
    longer = prompt + full[:stop_at + 1] + [9] * 8
    got = llm_steps.generate({"prompt_token_ids": longer}, SamplingParams(max_tokens=8, temperature=0.0,
                                                                         ignore_eos=True), use_tqdm=False)
    assert engine.block_manager.num_prefix_hits > 0
    assert got[0].outputs[0].token_ids == hf_greedy_ids(checkpoints["llama"][1], [longer], 8)[0]


def test_several_steps_keep_seeded_samples_and_logprobs(llm_steps, llm_pp2):
    params = SamplingParams(max_tokens=11, temperature=1.0, seed=1234, ignore_eos=True, logprobs=2)
    prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [9, 9, 1, 2]}]
    one = [o.outputs[0] for o in llm_pp2.generate(prompts, params, use_tqdm=False)]
    several = [o.outputs[0] for o in llm_steps.generate(prompts, params, use_tqdm=False)]
    for a, b in zip(one, several):
        assert a.token_ids == b.token_ids and len(b.logprobs) == 11
        assert all(abs(a.logprobs[i][t].logprob - b.logprobs[i][t].logprob) < 1e-4 for i, t in enumerate(a.token_ids))


def test_async_scheduling_runs_a_decode_ahead_of_its_token():
    bm = BlockManager(16, 4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, run_ahead_max_seqs=8)
    a, b = _req("a", 7, max_tokens=3), _req("b", 3, max_tokens=1)
    sched.add(a)
    sched.add(b)
    first = sched.schedule()
    assert first.sampled == [a, b] and a.block_ids == [0, 1] and b.block_ids == [2]
    # both are out; "a" may take the token it is about to get as its next input, "b" wants no second token
    ahead = sched.schedule()
    assert ahead.requests == [a] and ahead.sampled == [a]
    sb = ahead.stage_batch
    assert sb.input_ids.tolist() == [AHEAD_TOKEN] and sb.ahead_req_ids == ["a"]
    assert sb.positions.tolist() == [7] and sb.slot_mapping.tolist() == [7] and sb.seq_lens.tolist() == [8]
    stage = StageBlockTables()  # what the stage does with the two batches' table changes
    stage.apply(first.stage_batch.table_changes, 2, first.batch_id)
    sb.block_tables = stage.apply(sb.table_changes, 1, ahead.batch_id)
    assert sb.block_tables.tolist() == [a.block_ids] and len(sb.table_changes.new_ids) == 0
    sb.check(16, 4, 100, is_first=True, is_last=True)
    assert a.num_tokens == 8 and a.in_flight == 2
    sched.add(_req("c", 3, max_tokens=1))
    assert sched.schedule() is None  # one batch ahead at most, and no second batch of other requests
    _return_tokens(first, token=42)  # the placeholder becomes the token that came back
    assert a.output_token_ids == [42] and a.num_ahead == 0 and a.num_tokens == 8
    sched.finish(b, "length")
    assert b.block_ids == [] and bm.num_free_blocks == 14
    # "a" runs ahead again, a block further on; its third token would be its last, so no more after that
    nxt = sched.schedule()
    assert [r.request_id for r in nxt.requests] == ["a", "c"] and nxt.stage_batch.positions.tolist() == [8, 0, 1, 2]
    assert a.block_ids == [0, 1, 3] and nxt.stage_batch.ahead_req_ids == ["a"]
    assert nxt.stage_batch.finished_req_ids == ["b"]
    _return_tokens(ahead, token=43)
    assert sched.schedule() is None and a.num_tokens == 9
    # it stops on the token of the batch before: the batch still out keeps its blocks until it is back
    sched.finish(a, "stop")
    assert a.block_ids == [0, 1, 3] and a.num_computed_tokens == 9
    _return_tokens(nxt)
    bm.free(a)
    sched.finish(nxt.requests[1], "length")
    assert bm.num_free_blocks == 16


def test_async_scheduling_runs_ahead_only_while_few_requests_run():
    sched = Scheduler(BlockManager(16, 4), max_num_seqs=8, max_num_batched_tokens=64, run_ahead_max_seqs=1)
    sched.add(_req("a", 3))
    sched.add(_req("b", 3))
    assert len(sched.schedule().requests) == 2
    assert sched.schedule() is None  # two run: the next step waits for this one's tokens, as without async


def test_async_scheduling_needs_one_stage_and_one_step_a_batch():
    assert EngineConfig("m", distributed_executor_backend="mp").is_async_scheduling  # on by default where it applies
    assert not EngineConfig("m").is_async_scheduling  # the stage in this process: no round trip to overlap
    assert not EngineConfig("m", pipeline_parallel_size=2).is_async_scheduling
    assert not EngineConfig("m", num_scheduler_steps=4).is_async_scheduling
    assert not EngineConfig("m", async_scheduling=False).is_async_scheduling
    for bad in (dict(pipeline_parallel_size=2), dict(max_batches_in_flight=2), dict(num_scheduler_steps=4)):
        with pytest.raises(ValueError, match="async_scheduling"):
            EngineConfig("m", async_scheduling=True, **bad)
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig("m", async_scheduling="yes")


@pytest.fixture(scope="module")
def llm_async(llama_dir):
    """One stage process with async scheduling (the default there), each batch it was sent recorded."""
    with LLM(llama_dir, dtype=FP32, distributed_executor_backend="mp") as llm:
        assert llm.engine.config.is_async_scheduling
        sent, submit = [], llm.engine.executor.submit
        llm.engine.executor.submit = lambda batch: (sent.append(batch), submit(batch))[1]
        yield llm, sent


def test_async_scheduling_output_equals_hf_and_a_stop_drops_the_token_ahead(llm_async, checkpoints):
    llm, sent = llm_async
    prompt = [(5 * i + 4) % 300 for i in range(30)]
    full = hf_greedy_ids(checkpoints["llama"][1], [prompt], 12)[0]
    sent.clear()
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == full
    # each decode was sent while the batch that samples its input was out
    assert [len(b.ahead_req_ids) for b in sent] == [0] + [1] * 11
    stop_at = next(i for i in range(2, 12) if full[i] not in full[:i])  # a token not generated before it
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[full[stop_at]]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == full[:stop_at + 1] and out.finish_reason == "stop"
    engine = llm.engine
    assert engine.block_manager.num_free_blocks == engine.num_blocks
    # its cached blocks hold only its own tokens: a prompt that continues it decodes as HF does
    longer = prompt + full[:stop_at + 1] + [9] * 8
    got = llm.generate({"prompt_token_ids": longer}, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                       use_tqdm=False)
    assert engine.block_manager.num_prefix_hits > 0
    assert got[0].outputs[0].token_ids == hf_greedy_ids(checkpoints["llama"][1], [longer], 8)[0]


def test_async_scheduling_keeps_seeded_samples_logprobs_and_aborts(llm_async, llm_pp2):
    llm, sent = llm_async
    params = SamplingParams(max_tokens=11, temperature=1.0, seed=99, logprobs=2, n=2)
    prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [9, 9, 1, 2]}]
    sent.clear()
    got = [c for o in llm.generate(prompts, params, use_tqdm=False) for c in o.outputs]
    assert any(b.ahead_req_ids for b in sent)
    for a, b in zip([c for o in llm_pp2.generate(prompts, params, use_tqdm=False) for c in o.outputs], got):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        assert all(abs(a.logprobs[i][t].logprob - b.logprobs[i][t].logprob) < 1e-4 for i, t in enumerate(a.token_ids))
    engine = llm.engine
    engine.add_request("x", [1, 2, 3, 4, 5], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    receive, seen = engine.executor.receive, []

    def abort_then_receive():  # aborted while two of its batches are out
        seen.append(len(engine.in_flight))
        engine.abort_request("x")
        return receive()
    engine.executor.receive = abort_then_receive
    try:
        engine.step()
    finally:
        engine.executor.receive = receive
    while engine.in_flight:
        engine.step()
    assert seen == [2] and not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.num_blocks


def test_steps_default_to_256_tokens_with_several_cpu_stages():
    """A pipeline of CPU stages waits a step's time per stage to fill, and again where prefill turns to decode: its
    steps default to 256 tokens; one stage's, and GPU stages', to 512; a budget given is kept."""
    assert EngineConfig("m").max_num_batched_tokens == 512
    assert EngineConfig("m", pipeline_parallel_size=2).max_num_batched_tokens == 256
    assert EngineConfig("m", pipeline_parallel_size=2, device="cuda").max_num_batched_tokens == 512
    assert EngineConfig("m", pipeline_parallel_size=2, max_num_batched_tokens=1024).max_num_batched_tokens == 1024
    with pytest.raises(ValueError, match="max_num_batched_tokens=0: must be a positive integer"):
        EngineConfig("m", max_num_batched_tokens=0)
