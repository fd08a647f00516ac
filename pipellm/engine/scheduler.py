"""Decides which requests run in the next step and with how many tokens (vLLM v1 style).

A request is tracked as "tokens computed so far" against "tokens in total"; prefill, chunked prefill and decode
are the same thing with different counts, so one step can mix them.
"""
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from pipellm.config import SpeculativeConfig
from pipellm.engine import speculative
from pipellm.engine.block_manager import BlockManager
from pipellm.engine.lora_slots import LoRASlots
from pipellm.engine.sequence import Request, RequestStatus
from pipellm.pipeline.messages import BlockTableChanges, NewRequest, StageBatch


@dataclass
class ScheduledBatch:
    batch_id: int
    requests: list[Request]
    num_new_tokens: list[int]        # per request, tokens run this step
    sampled: list[Request]           # requests whose last known token is in this step: they get a new token
    #                                  (num_steps of them, when the stage runs several decode steps)
    stage_batch: StageBatch
    prompt_spans: list[tuple[Request, int, int]] = field(default_factory=list)  # (request, first prompt position
    #                                  scored, count) in the order of StageBatch.prompt_rows


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 recompute_past: int | None = None, send_rope_lens: bool = False, num_scheduler_steps: int = 1,
                 steps_alone: bool = False, run_ahead_max_seqs: int = 0, chunks_ahead: bool = False,
                 speculative_config: SpeculativeConfig | None = None, by_priority: bool = False,
                 max_loras: int = 0):
        self.block_manager = block_manager
        self.loras = LoRASlots(max_loras) if max_loras else None  # the stages' LoRA slots (enable_lora)
        # scheduling_policy "priority": waiting and running requests in priority order, the last of it preempted
        # first (as vLLM's); otherwise in arrival order, the last admitted preempted first
        self.by_priority = by_priority
        self.speculative_config = speculative_config
        # async scheduling (one stage): while at most this many requests run, a decoding request whose batch is out
        # may join the next batch too, its input the token the stage samples for it in the batch before
        self.run_ahead_max_seqs = run_ahead_max_seqs
        # several stages: a prompt's next chunk may go out while its last is still in the pipeline (each stage runs
        # batches in the order they were sent, so its K/V is written first), and a long prompt's chunks fill stages
        self.chunks_ahead = chunks_ahead
        # several steps a batch; with steps_alone (several stages), only for a batch of every running request: its
        # stages pass each step on to each other, and a second batch in flight would wait for all of its steps
        self.num_scheduler_steps, self.steps_alone = num_scheduler_steps, steps_alone
        self.send_rope_lens = send_rope_lens  # dynamic and longrope rotary scale by each sequence's known length
        # longrope: a sequence that grows past this length recomputes its cache with the long factors (as HF's Phi-3)
        self.recompute_past = recompute_past
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished_ids: list[str] = []  # to tell the last stage to drop their sampling state
        self.num_batches = 0
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        self._wait(req)

    def _wait(self, req: Request, preempted: bool = False) -> None:
        if not self.by_priority:
            return self.waiting.appendleft(req) if preempted else self.waiting.append(req)
        key = _order(req)
        self.waiting.insert(next((i for i, r in enumerate(self.waiting) if _order(r) > key), len(self.waiting)), req)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def finish(self, req: Request, reason: str) -> None:
        req.status, req.finish_reason = RequestStatus.FINISHED, reason
        req.num_ahead = 0  # a token still to come for it is dropped
        # after several decode steps, the cache may hold steps past the token that ended it: not its tokens
        req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens)
        if req in self.running:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        if not req.in_flight:  # an in-flight request's blocks are still being written; freed when it returns
            self.block_manager.free(req)
        if req.is_known_to_sampler:
            self.finished_ids.append(req.request_id)

    def _preempt(self, req: Request) -> None:
        # Recompute later: drop its cache, keep its tokens. Output stays the same (greedy or seeded).
        assert not req.in_flight
        self.running.remove(req)
        self.block_manager.free(req)
        req.num_computed_tokens, req.status = 0, RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._wait(req, preempted=True)

    def drop_suspects(self, out: list[Request]) -> list[Request]:
        """After a pipeline failure, out: the unfinished requests of the batches that were out. A suspect among them
        went out with no other suspect, so the failure is likely its own (an input a stage fails on every time):
        it ends (finish_reason "abort") rather than fail the next pipeline too. The rest become suspects. Returns the
        requests dropped."""
        dropped = [r for r in out if r.suspect]
        for r in dropped:
            r.in_flight = 0
            self.finish(r, "abort")
        for r in out:
            r.suspect = True
        return dropped

    def _suspect_out(self) -> bool:
        return any(r.suspect and r.in_flight for r in self.running)

    def requeue_all(self, block_manager: BlockManager) -> None:
        """After a pipeline restart: every unfinished request waits to recompute its prompt and output so far,
        in the new pipeline's empty caches, in its old order."""
        self.block_manager = block_manager
        for req in self.running + list(self.waiting):
            req.num_computed_tokens, req.block_ids, req.status = 0, [], RequestStatus.WAITING
            req.window_block_ids = []
            req.in_flight, req.num_ahead, req.is_known_to_sampler, req.draft_token_ids = 0, 0, False, []
            req.table_row, req.blocks_sent = -1, 0  # the new stages hold no rows
        if self.loras is not None:
            self.loras.reset()  # nor adapters
        self.waiting = deque(self.running + list(self.waiting))
        if self.by_priority:
            self.waiting = deque(sorted(self.waiting, key=_order))
        self.running, self.finished_ids = [], []

    @property
    def num_schedulable_tokens(self) -> int:
        """Tokens that requests could run now (those not in flight, and prompt chunks that may go ahead)."""
        return sum(r.num_pending_tokens for r in self.running if not r.in_flight or self._can_chunk_ahead(r)) + \
            sum(r.num_pending_tokens for r in self.waiting)

    def schedule(self, max_num_seqs: int | None = None, max_num_tokens: int | None = None) -> ScheduledBatch | None:
        """Picks requests not in flight (and prompts' next chunks, chunks_ahead), within the token budget and free KV
        blocks. None if nothing can run.
        max_num_seqs bounds the requests that run one token (decodes); prompts, new or going on, take the token
        budget, so that the batches in flight split the prompts' tokens as well as the decodes."""
        if self.run_ahead_max_seqs and any(r.in_flight for r in self.running) and \
                not any(self._can_run_ahead(r) for r in self.running):
            return None  # one stage: a second batch only to run decodes ahead, never a split of the requests
        max_seqs = min(self.max_num_seqs, max_num_seqs or self.max_num_seqs)
        budget = min(self.max_num_batched_tokens, max_num_tokens or self.max_num_batched_tokens)
        chosen: list[tuple[Request, int]] = []
        suspect_out = self._suspect_out()  # one suspect out at a time, so a failure names it
        for req in sorted(self.running, key=_order) if self.by_priority else list(self.running):
            if len(chosen) == self.max_num_seqs or budget == 0:
                break
            if req not in self.running or (len(chosen) >= max_seqs and req.num_pending_tokens <= 1):
                continue
            if req.suspect and not req.in_flight:
                if suspect_out:
                    continue
                suspect_out = True
            if req.in_flight:
                if self._can_run_ahead(req):
                    self.block_manager.allocate_ahead(req, 1)
                    req.num_ahead = 1
                    chosen.append((req, 1))
                    budget -= 1
                elif self._can_chunk_ahead(req):
                    n = min(req.num_pending_tokens, budget)
                    if self.block_manager.can_allocate(req, n):  # no preemption for it: the others' turn comes first
                        self.block_manager.allocate_ahead(req, n)
                        chosen.append((req, n))
                        budget -= n
                continue
            if self.recompute_past is not None and req.rope_len <= self.recompute_past < req.num_tokens:
                self._preempt(req)
                continue
            n = min(req.num_pending_tokens, budget)
            while not self.block_manager.can_allocate(req, n):
                victims = [r for r in self.running if not r.in_flight and r is not req
                           and all(r is not c for c, _ in chosen)]
                if not victims:
                    break
                victim = max(victims + [req], key=_order) if self.by_priority else victims[-1]
                self._preempt(victim)
                if victim is req:  # the last in priority order waits
                    break
            if req.status is RequestStatus.WAITING:
                continue
            if not self.block_manager.can_allocate(req, n):
                if not any(r.in_flight for r in self.running) and not chosen:
                    self._preempt(req)  # alone and still too big: wait until memory frees up
                continue
            self.block_manager.allocate(req, n)
            chosen.append((req, n))
            budget -= n
        # a prompt admitted below may take the full blocks this batch's prompt chunks write (a request's n > 1
        # completions, say); a decode's block is indexed as the batch goes (several steps may write past it)
        for req, n in chosen:
            if n > 1:
                self.block_manager.cache_sent_blocks(req, n)
        # max_num_seqs bounds the running requests of every batch in flight together, as vLLM's does
        skipped = []  # requests whose LoRA adapter waits for a slot: the ones behind them go ahead
        while self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
            req = self.waiting[0]
            if req.suspect and (suspect_out or any(r.suspect for r, _ in chosen)):
                break
            slot = -1 if self.loras is None else self.loras.slot_for(req, self.running)
            if slot is None:  # every slot holds another adapter that a running request needs
                skipped.append(self.waiting.popleft())
                continue
            # its K/V is already there: compute only the rest
            bm = self.block_manager
            if bm.saved is not None and req.parent_id is not None and req.use_prefix_cache and any(
                    r.parent_id == req.parent_id and r.state_saves for r in self.running):
                break  # a completion of its request still saves the prompt's states: go on from them after it
            cached = bm.cached_prefix(req) if req.use_prefix_cache else []
            partial = bm.cached_partial(req, cached) if req.use_prefix_cache else None
            n = min(req.num_tokens - len(cached) * bm.block_size - (partial[1] if partial else 0), budget)
            if not bm.can_allocate(req, n, cached, partial):
                break
            if self.loras is not None:
                self.loras.take(req, slot)
            self.waiting.popleft()
            bm.allocate(req, n, cached, partial)
            if n > 1:
                bm.cache_sent_blocks(req, n)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            chosen.append((req, n))
            budget -= n
        self.waiting.extendleft(reversed(skipped))
        if not chosen:
            return None
        if self.speculative_config is not None:
            self._add_drafts(chosen)
        return self._build(chosen, self._num_steps(chosen))

    def _add_drafts(self, chosen: list[tuple[Request, int]]) -> None:
        """Drafts for the chosen requests that run their last token (speculative_config), within the step's token
        limit and the free blocks: they never take a block or a token another request needs."""
        spec, bm = self.speculative_config, self.block_manager
        room = self.max_num_batched_tokens - sum(n for _, n in chosen)
        if room <= 0 or bm.window_ring or self.send_rope_lens or self.recompute_past is not None:
            return
        for i, (req, n) in enumerate(chosen):
            left = min(room, spec.num_speculative_tokens, req.max_tokens - len(req.output_token_ids) - 1)
            if (n != req.num_pending_tokens or req.num_ahead or req.in_flight or left < 1
                    or not speculative.can_speculate(req.params, len(req.output_token_ids))):
                continue
            drafts = speculative.propose(req.token_array(), left, spec.prompt_lookup_min, spec.prompt_lookup_max)
            if drafts and bm.can_allocate(req, n + len(drafts)):
                bm.allocate(req, n + len(drafts))
                req.draft_token_ids = drafts
                chosen[i] = (req, n + len(drafts))
                room -= len(drafts)

    def _can_run_ahead(self, req: Request) -> bool:
        """Whether req may join the next batch while its batch is out: few requests run, that batch runs all its
        known tokens and samples the next (which the new batch takes as input), and one more is wanted after it."""
        return (len(self.running) <= self.run_ahead_max_seqs and req.in_flight == 1 and req.num_ahead == 0
                and req.num_pending_tokens == 0
                and len(req.output_token_ids) + 2 <= req.max_tokens and req.params.prompt_logprobs is None
                and not self.block_manager.window_ring and not self.send_rope_lens and self.recompute_past is None
                and self.block_manager.can_allocate(req, 1))

    def _can_chunk_ahead(self, req: Request) -> bool:
        """Whether req, with a batch out, may run its next known tokens in the next batch too (chunks_ahead): only
        prompt (or recomputed) tokens, as the batch out samples no token for it."""
        return (self.chunks_ahead and req.num_pending_tokens > 0 and req.params.prompt_logprobs is None
                and not self.send_rope_lens and self.recompute_past is None)

    def _num_steps(self, chosen: list[tuple[Request, int]]) -> int:
        """How many decode steps the stage runs in a row (num_scheduler_steps), with their blocks allocated: only
        when every chosen request decodes, none waits to start, and each has that many tokens left to generate."""
        steps = self.num_scheduler_steps
        if steps == 1 or self.waiting or self.block_manager.window_ring or self.send_rope_lens or any(
                n != 1 or r.num_pending_tokens != 1 or r.num_ahead or r.in_flight
                or r.params.prompt_logprobs is not None
                for r, n in chosen) or (
                self.steps_alone and len(chosen) < len(self.running)):
            return 1
        bm = self.block_manager
        steps = min(steps, *(r.max_tokens - len(r.output_token_ids) for r, _ in chosen))
        if steps <= 1 or sum(bm.num_blocks_needed(r, steps) for r, _ in chosen) > bm.num_free_blocks:
            return 1
        for r, _ in chosen:
            bm.allocate(r, steps)
        return steps

    def _build(self, chosen: list[tuple[Request, int]], steps: int = 1) -> ScheduledBatch:
        bs = self.block_manager.block_size
        reqs = [r for r, _ in chosen]
        counts = np.array([n for _, n in chosen], dtype=np.int64)
        starts = np.array([r.num_computed_tokens for r in reqs], dtype=np.int64)
        ids = np.concatenate([np.asarray(r.token_ids(s, s + n - len(r.draft_token_ids)) + r.draft_token_ids,
                                         dtype=np.int64) for r, (s, n) in zip(reqs, zip(starts, counts))])
        # Positions of all new tokens at once: each sequence's start plus 0..n-1.
        offsets = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        positions = np.repeat(starts, counts) + offsets
        # The new tokens' slots from the blocks they fall in (a decode's one block), not from whole tables: the
        # stages build those from table_changes.
        first, last = starts // bs, (starts + counts - 1) // bs                          # [B] blocks touched
        touched = [r.block_ids[f:l + 1] for r, f, l in zip(reqs, first.tolist(), last.tolist())]
        base = np.cumsum([0] + [len(t) for t in touched[:-1]])                          # [B] offsets in flat
        flat = np.array([b for t in touched for b in t], dtype=np.int64)
        window_tables = None
        if self.block_manager.window_ring:
            window_tables = np.zeros((len(reqs), self.block_manager.window_ring), dtype=np.int32)
            for i, r in enumerate(reqs):
                window_tables[i, :len(r.window_block_ids)] = r.window_block_ids
        rows = np.repeat(np.arange(len(reqs)), counts)
        slots = flat[base[rows] + positions // bs - first[rows]] * bs + positions % bs
        seq_lens = starts + counts
        rope_lens = np.array([r.num_tokens for r in reqs], dtype=np.int64)
        num_drafts = np.array([len(r.draft_token_ids) for r in reqs], dtype=np.int64)
        is_sampled = seq_lens == rope_lens + num_drafts  # it runs its last known token (and its drafts)
        sampled = [r for r, s in zip(reqs, is_sampled) if s]
        new = [NewRequest(r.request_id, r.params, r.prompt_token_ids, r.seed, list(r.output_token_ids),
                          r.min_tokens_stop_ids, r.bad_words_token_ids)
               for r in sampled if not r.is_known_to_sampler]
        # a sampled request's last row, and before it one row for each draft: the row that verifies it
        logits_indices = np.flatnonzero(is_sampled[rows] & (offsets >= counts[rows] - 1 - num_drafts[rows]))
        drafts = None
        if num_drafts.any():  # each logits row's draft to verify; -1 on a sampled request's last row
            drafts = np.concatenate([np.array(r.draft_token_ids + [-1], dtype=np.int64) for r in sampled])
        spans, prompt_rows = self._prompt_rows(reqs, starts, counts)
        for r, n in chosen:
            r.num_computed_tokens += n if steps == 1 else steps
            r.in_flight += 1
            r.rope_len = r.num_tokens
            self.block_manager.cache_sent_blocks(r)
        for r in sampled:
            r.is_known_to_sampler = True
        batch = StageBatch(self.num_batches, ids, positions, slots, counts, seq_lens, None, logits_indices,
                           [r.request_id for r in sampled for _ in range(len(r.draft_token_ids) + 1)], new,
                           self.finished_ids,
                           rope_lens if self.send_rope_lens else None, window_tables,
                           ahead_req_ids=[r.request_id for r in reqs if r.num_ahead], num_steps=steps,
                           table_changes=self._table_changes(reqs), draft_token_ids=drafts)
        if self.block_manager.saved is not None:  # states of cached prefixes loaded, and states to save
            batch.state_loads = self.block_manager.saved.take_loads()
            batch.state_saves = self.block_manager.saved.saves(reqs, starts, counts, bs, steps)
        if self.loras is not None:
            batch.lora_loads = self.loras.take_loads()
            if any(r.lora_slot >= 0 for r in reqs):
                batch.lora_slots = np.array([r.lora_slot for r in reqs], dtype=np.int64)
        if self.block_manager.pending_copies:  # kept partial blocks copied for the requests admitted here
            batch.block_copies = np.array(self.block_manager.pending_copies, dtype=np.int64)
            self.block_manager.pending_copies = []
        if spans:
            batch.prompt_rows, batch.prompt_targets = prompt_rows
            batch.prompt_top_k = max(r.params.prompt_logprobs for r, _, _ in spans)
        self.finished_ids = []
        self.num_batches += 1
        return ScheduledBatch(batch.batch_id, reqs, counts.tolist(), sampled, batch, spans)

    @staticmethod
    def _table_changes(reqs: list[Request]) -> BlockTableChanges:
        """The block ids each request's row gains with this batch; from now on the stages hold them."""
        keep = [r.blocks_sent for r in reqs]
        new = [r.block_ids[k:] for r, k in zip(reqs, keep)]
        for r in reqs:
            r.blocks_sent = len(r.block_ids)
        return BlockTableChanges(np.array([r.table_row for r in reqs], dtype=np.int64), np.array(keep, dtype=np.int64),
                                 np.array([len(n) for n in new], dtype=np.int64),
                                 np.array([b for n in new for b in n], dtype=np.int32))

    @staticmethod
    def _prompt_rows(reqs: list[Request], starts: np.ndarray, counts: np.ndarray):
        """For requests that want prompt log-probabilities: the rows of this step that score a next prompt token
        not scored yet, and those tokens. A row at position p scores prompt token p + 1. A recomputed prompt (after
        a preemption, or a long-factor rotary's switch) keeps the scores of its first pass, which saw only the
        prompt, as a model given just the prompt does."""
        spans, rows, targets = [], [], []
        first_rows = np.cumsum(counts) - counts
        for r, start, n, row in zip(reqs, starts.tolist(), counts.tolist(), first_rows.tolist()):
            end = min(start + n, r.num_prompt_tokens - 1)
            if r.params.prompt_logprobs is None:
                continue
            while start < end and r.prompt_logprobs[start + 1] is not None:  # scored by an earlier pass
                start, row = start + 1, row + 1
            if end <= start:
                continue
            spans.append((r, start + 1, end - start))
            rows.append(np.arange(row, row + end - start))
            targets.append(np.asarray(r.prompt_token_ids[start + 1:end + 1], dtype=np.int64))
        return spans, (np.concatenate(rows), np.concatenate(targets)) if spans else None


def _order(req: Request) -> tuple[int, float]:
    return req.priority, req.arrival_time
