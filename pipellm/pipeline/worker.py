"""A stage's work: its contiguous range of layers, their weights and KV caches, and the batches it runs. The
process around it (set-up, rendezvous, heartbeat) is stage.py's; a one-stage pipeline runs it in the driver's."""
import os
import time
from collections import deque
from functools import partial

import torch

from pipellm import structured
from pipellm.loader.gguf import gguf_source, load_gguf_stage_weights
from pipellm.loader.safetensors import load_stage_weights
from pipellm.lora import StageAdapters
from pipellm.models.attention import AttentionMetadata
from pipellm.models.huge_pages import weights_on_huge_pages
from pipellm.models.kv_cache import KVCache, cache_dtype
from pipellm.models.layers import share_tied_embedding, transpose_linears
from pipellm.models.linear_attention import KVAndState, LinearState, layer_cache
from pipellm.models.registry import build_stage_model
from pipellm.quant.linear import GREEDY_MIN_ROWS, densify, set_int8_activations, weight_bytes
from pipellm.quant.rtn import LoadQuantizer, quantize_linears
from pipellm.pipeline import comm, graphs, probe
from pipellm.pipeline.block_tables import StageBlockTables
from pipellm.pipeline.messages import (AHEAD_TOKEN, Inspect, ProbeReport, SampledBatch, Shutdown, StageArgs,
                                       StageBatch, StageReport)
from pipellm.sampler import Sampler, prompt_logprobs

MAX_EVENTS = 200_000  # trace events a stage keeps between two reports


class StageWorker:
    def __init__(self, args: StageArgs, device: torch.device = torch.device("cpu")):
        self.args, self.stage, self.device = args, args.stage, device
        cfg, ecfg = args.model_config, args.engine_config
        self.is_sliding = [cfg.is_sliding(i) for i in range(self.stage.start, self.stage.end)]
        spec = ecfg.speculative_config  # a token and its drafts attend as decodes: the decode step's kernels
        self.decode_chunks = 1 + spec.num_speculative_tokens if spec is not None else 1
        if gguf_source(args.model_dir):  # built without memory, then filled with compact weights from the file
            self.model = build_stage_model(cfg, self.stage, meta=True).to(ecfg.torch_dtype)
            self.checkpoint_tensors = load_gguf_stage_weights(self.model, args.model_dir, ecfg.torch_dtype)
        else:  # no random init (0.6 s for half the default model): the loader fills every parameter, or refuses
            self.model = build_stage_model(cfg, self.stage, meta=True)
            quantizer = LoadQuantizer(self.model, ecfg.quantization, ecfg.torch_dtype) if ecfg.quantization else None
            # quantization rounds the embedding too, on every stage alike (greedy output stays one for every PP)
            self.checkpoint_tensors = load_stage_weights(self.model, args.model_dir, ecfg.torch_dtype, quantizer,
                                                         map_embeddings=quantizer is None)
            if ecfg.quantization:
                quantize_linears(self.model, ecfg.quantization)  # what the quantizer left: tied weights
        if device.type != "cpu":
            densify(self.model, ecfg.torch_dtype)  # our compact kernels are CPU code
        set_int8_activations(self.model, ecfg.int8_activations)
        transpose_linears(self.model)
        share_tied_embedding(self.model)
        self.adapters = StageAdapters(self.model, ecfg.torch_dtype, device) if ecfg.enable_lora else None
        if device.type == "cpu":
            weights_on_huge_pages(self.model)
        self.model.eval().to(device)
        kv_dtype = cache_dtype(ecfg.kv_cache_dtype, ecfg.torch_dtype)
        eager_why = graphs.supported(cfg, ecfg, device, args.num_window_blocks)
        # sliding-window layers have caches of their own when the driver gives them rings of blocks; the decode
        # graphs' padding rows write to a block past the driver's; linear-attention layers hold states instead
        self.kv_caches = [layer_cache(cfg, i, ecfg.torch_dtype, device, partial(
            KVCache.allocate, args.num_window_blocks if sliding and args.num_window_blocks
            else args.num_blocks + (eager_why is None), ecfg.block_size, *cfg.cache_shape(i), kv_dtype, device,
            shared=cfg.is_mla)) for i, sliding in zip(range(self.stage.start, self.stage.end), self.is_sliding)]
        self.attention_caches = [c.kv if isinstance(c, KVAndState) else c for c in self.kv_caches
                                 if isinstance(c, (KVCache, KVAndState))]
        self.states = [c.state if isinstance(c, KVAndState) else c for c in self.kv_caches
                       if isinstance(c, (LinearState, KVAndState))]
        self.graphs = None if eager_why else graphs.DecodeGraphs(
            self.model, self.kv_caches, self.is_sliding, cfg.sliding_window, ecfg.block_size, ecfg.max_num_seqs,
            capture=device.type == "cuda")
        tokenizer = partial(structured.ll_tokenizer_of_folder, args.model_dir, cfg.vocab_size)
        self.sampler = Sampler(tokenizer) if self.stage.is_last else None
        if self.stage.is_last:  # greedy picks' per-token bounds, made now rather than by the first batch (~0.1-1 s)
            with torch.inference_mode():
                self.model.greedy_ids(torch.ones(GREEDY_MIN_ROWS, cfg.hidden_size, dtype=ecfg.torch_dtype,
                                                 device=device))
        self.last_tokens: dict[str, int] = {}  # request id -> the token sampled for it in the last batch
        self.steps = self.bytes_sent = self.tokens_sent = 0
        self.busy_s = 0.0  # time computing, not waiting for input
        self.block_tables = StageBlockTables()
        self.chan: comm.Channel | None = None
        # (kind, batch id, start, end, tokens, sequences), perf_counter clock; None when not tracing.
        self.events: deque[tuple] | None = deque(maxlen=MAX_EVENTS) if ecfg.trace else None

    @property
    def world_rank(self) -> int:
        return comm.stage_world_rank(self.stage.rank)

    def serve(self, chan: comm.Channel) -> None:
        self.chan = chan
        while True:
            waiting_since = time.perf_counter()
            msg = chan.recv_obj(comm.DRIVER, (StageBatch, Inspect, Shutdown))
            if isinstance(msg, Shutdown):
                return  # without waiting on pending sends: results of batches in flight have no reader now
            if isinstance(msg, Inspect):
                chan.send_obj(self.report(), comm.DRIVER)
            else:
                self._record("wait_batch", msg, waiting_since)
                self.step(msg)

    def _record(self, kind: str, batch: StageBatch, start: float, end: float | None = None) -> None:
        if self.events is not None:
            self.events.append((kind, batch.batch_id, start, end or time.perf_counter(), batch.num_tokens,
                                len(batch.query_lens)))

    @torch.inference_mode()
    def step(self, batch: StageBatch) -> None:
        cfg, ecfg = self.args.model_config, self.args.engine_config
        if batch.table_changes is not None:
            batch.block_tables = self.block_tables.apply(batch.table_changes, len(batch.query_lens), batch.batch_id)
        batch.check(self.args.num_blocks, ecfg.block_size, cfg.vocab_size, self.stage.is_first, self.stage.is_last,
                    self.args.num_window_blocks, ecfg.max_loras if ecfg.enable_lora else 0)
        if self.adapters is not None:  # LoRA adapters loaded, and the rows of each slot this step
            for load in batch.lora_loads:
                self.adapters.load(load.slot, load.path)
            self.adapters.set_step(batch.lora_slots, batch.query_lens)
        if batch.block_copies is not None:
            src, dst = (torch.from_numpy(c).to(self.device) for c in batch.block_copies.T)
            for cache in self.attention_caches:
                cache.copy_blocks(src, dst)
        if batch.state_loads is not None:  # a cached prefix's states, into the rows of the sequences that take it
            loads = batch.state_loads.tolist()
            for state in self.states:
                for slot, row in loads:
                    state.load(slot, row)
        if batch.num_steps > 1:
            return self._decode_steps(batch)
        t, dev = torch.from_numpy, self.device
        graph = self.graphs is not None and not batch.probe and self.graphs.applies(batch.query_lens, batch.seq_lens)
        if not graph:
            positions = t(batch.positions)
            meta = AttentionMetadata.for_layers(self.is_sliding, cfg.sliding_window, positions, t(batch.query_lens),
                                                t(batch.seq_lens), t(batch.block_tables), t(batch.slot_mapping),
                                                ecfg.block_size, window_tables=None if batch.window_block_tables
                                                is None else t(batch.window_block_tables),
                                                decode_chunks=self.decode_chunks, attention_chunk=cfg.attention_chunk)
            if batch.rope_lens is not None:
                meta.rope_lens = t(batch.rope_lens)
            meta.state_rows = t(batch.table_changes.rows) if batch.table_changes is not None else None
            if batch.state_saves is not None:
                meta.state_saves = {}
                for i, k, slot in batch.state_saves.tolist():
                    meta.state_saves.setdefault(i, []).append((k, slot))
            meta, positions = meta.to(dev), positions.to(dev)
        if self.stage.is_first:
            x = self._input_ids(batch) if graph else t(self._input_ids(batch)).to(dev)
        else:
            waiting_since = time.perf_counter()
            x = self._recv_hidden((batch.num_tokens, cfg.hidden_size))
            self._record("wait_hidden", batch, waiting_since)
        recorder = probe.Recorder(self.model.layers, self.is_sliding, meta) if batch.probe else None
        start = time.perf_counter()
        if graph:
            hidden = self.graphs.run(x, batch.positions, batch.seq_lens, batch.block_tables, batch.slot_mapping)
        else:
            hidden = self.model(x, positions, meta, self.kv_caches)
        self.steps += 1
        if not self.stage.is_last:
            self.busy_s += time.perf_counter() - start
            self._record("forward", batch, start)
            self._send_hidden(hidden)
            if recorder is not None:
                self._finish_probe(batch, recorder, [])
            return
        self._update_sampler(batch)
        tokens, prompt_lps, accepted = [], None, None
        if len(batch.logits_indices):
            rows = hidden[t(batch.logits_indices).to(dev)]
            if batch.draft_token_ids is None:
                tokens = self._sample(rows, batch.sample_req_ids)
            else:  # speculative decoding: drafts kept, then each request's own token
                req_ids = batch.sample_req_ids
                plain = len(self.sampler.plain_greedy_rows(req_ids)) == len(req_ids)
                ids = self.model.greedy_ids(rows) if plain else None
                logits = self.model.compute_logits(rows) if ids is None else None
                tokens, accepted = self.sampler.verify(logits, req_ids, batch.draft_token_ids, ids)
        if self.stage.is_first:  # a one-stage pipeline: the next batch may take these tokens (async scheduling)
            self.last_tokens = {r: tok.token_id for r, tok in zip(batch.sample_req_ids, tokens)}
        if batch.prompt_rows is not None:
            prompt_lps = prompt_logprobs(self.model.compute_logits, hidden[t(batch.prompt_rows).to(dev)],
                                         t(batch.prompt_targets).to(dev), batch.prompt_top_k)
        self.busy_s += time.perf_counter() - start
        self._record("forward", batch, start)
        self.chan.send_obj(SampledBatch(batch.batch_id, tokens, prompt_lps, accepted), comm.DRIVER)
        if recorder is not None:
            self._finish_probe(batch, recorder, tokens)

    def _input_ids(self, batch: StageBatch):
        if not batch.ahead_req_ids:
            return batch.input_ids
        missing = [r for r in batch.ahead_req_ids if r not in self.last_tokens]
        if missing:
            raise ValueError(f"StageBatch {batch.batch_id}: ahead_req_ids {missing[:3]} were not sampled in the "
                             "batch before")
        ids = batch.input_ids.copy()
        ids[ids == AHEAD_TOKEN] = [self.last_tokens[r] for r in batch.ahead_req_ids]
        return ids

    def _recv_hidden(self, shape: tuple) -> torch.Tensor:
        return self.chan.recv_hidden(shape, self.args.engine_config.torch_dtype, self.world_rank - 1, self.device)

    def _send_hidden(self, hidden: torch.Tensor) -> None:
        self.chan.send_hidden(hidden, self.world_rank + 1)
        self.bytes_sent += hidden.numel() * hidden.element_size()
        self.tokens_sent += hidden.shape[0]

    def _sample(self, hidden: torch.Tensor, req_ids: list[str]) -> list:
        """The last stage's tokens for hidden's rows (its layers' output, one row a request): plain greedy rows
        through the model's greedy_ids where it applies, the others (or all) from their logits."""
        plain = self.sampler.plain_greedy_rows(req_ids)
        ids = self.model.greedy_ids(hidden[plain] if len(plain) < len(req_ids) else hidden) if plain else None
        if ids is None:
            return self.sampler.sample(self.model.compute_logits(hidden), req_ids)
        tokens = dict(zip(plain, self.sampler.take(ids, [req_ids[i] for i in plain])))
        rest = [i for i in range(len(req_ids)) if i not in tokens]
        if rest:
            logits = self.model.compute_logits(hidden[rest])
            tokens.update(zip(rest, self.sampler.sample(logits, [req_ids[i] for i in rest])))
        return [tokens[i] for i in range(len(req_ids))]

    def _update_sampler(self, batch: StageBatch) -> None:
        for req_id in batch.finished_req_ids:
            self.sampler.remove_request(req_id)
        for req in batch.new_requests:
            self.sampler.add_request(req.req_id, req.params, req.prompt_token_ids, req.seed, req.output_token_ids,
                                     req.min_tokens_stop_ids, req.bad_words_token_ids)

    def _decode_steps(self, batch: StageBatch) -> None:
        """batch.num_steps decode steps of its sequences, each step one position on, in the slots their block tables
        give. The last stage's samples are the next step's input: it sends them to the first stage (only token ids
        cross), and the driver gets every step's tokens at the end."""
        cfg, ecfg, stage = self.args.model_config, self.args.engine_config, self.stage
        t, bs, dev = torch.from_numpy, ecfg.block_size, self.device
        self.last_tokens = {}  # no batch runs ahead of several steps
        first_rank = comm.stage_world_rank(0)
        last_rank = comm.stage_world_rank(self.args.num_stages - 1)
        if stage.is_last:
            self._update_sampler(batch)
        ids, positions, query_lens, seq_lens = (None if batch.input_ids is None else t(batch.input_ids),
                                                t(batch.positions), t(batch.query_lens), t(batch.seq_lens))
        tables = t(batch.block_tables)
        rows = torch.arange(len(query_lens))
        state_rows = None if batch.table_changes is None else t(batch.table_changes.rows)
        tokens = []
        for step in range(batch.num_steps):
            waiting_since = time.perf_counter()
            if step:
                positions, seq_lens = positions + 1, seq_lens + 1
                if stage.is_first:
                    ids = sampled if stage.is_last else self.chan.recv_tensor((len(rows),), torch.int64, last_rank)
                    if not bool(((ids >= 0) & (ids < cfg.vocab_size)).all()):
                        raise ValueError(f"StageBatch {batch.batch_id}: the last stage sent token ids outside the "
                                         f"vocabulary of {cfg.vocab_size}")
            x = ids if stage.is_first else self._recv_hidden((len(rows), cfg.hidden_size))
            start = time.perf_counter()
            if step or not stage.is_first:  # (the batch's own wait is recorded by serve())
                self._record("wait_hidden", batch, waiting_since, start)
            slots = tables[rows, positions // bs].long() * bs + positions % bs
            if self.graphs is not None and self.graphs.applies(query_lens.numpy(), seq_lens.numpy()):
                hidden = self.graphs.run(x.numpy() if stage.is_first else x, positions.numpy(), seq_lens.numpy(),
                                         batch.block_tables, slots.numpy())
            else:
                meta = AttentionMetadata.for_layers(self.is_sliding, cfg.sliding_window, positions, query_lens,
                                                    seq_lens, tables, slots, bs, attention_chunk=cfg.attention_chunk)
                meta.state_rows = state_rows
                hidden = self.model(x.to(dev), positions.to(dev), meta.to(dev), self.kv_caches)
            if not stage.is_last:
                self._send_hidden(hidden)
            else:
                step_tokens = self._sample(hidden, batch.sample_req_ids)
                tokens += step_tokens
                sampled = torch.tensor([tok.token_id for tok in step_tokens])               # [B] the next input
                if not stage.is_first and step + 1 < batch.num_steps:
                    self.chan.send_tensor(sampled, first_rank)
            self.busy_s += time.perf_counter() - start
            self._record("forward", batch, start)
        self.steps += batch.num_steps
        if stage.is_last:
            self.chan.send_obj(SampledBatch(batch.batch_id, tokens), comm.DRIVER)

    def _finish_probe(self, batch: StageBatch, recorder: probe.Recorder, tokens: list) -> None:
        """After a probe batch: every layer's output so far goes on to the next stage (activations, like the hidden
        states), and the last stage reads them through its norm and LM head. Each stage reports to the driver."""
        recorder.close()
        cfg, dtype = self.args.model_config, self.args.engine_config.torch_dtype
        # through host memory (a probe is rare and small), like the layers' outputs of earlier stages
        outputs = torch.stack(recorder.outputs).cpu()                            # [layers here, T, hidden]
        if not self.stage.is_first:
            earlier = self.chan.recv_tensor((self.stage.start, batch.num_tokens, cfg.hidden_size), dtype,
                                            self.world_rank - 1)
            outputs = torch.cat([earlier, outputs])                              # [layers so far, T, hidden]
        # Gemma 4's full-attention layers, of fewer KV heads, grouped as its others are
        fields = recorder.report_fields(self.kv_caches, cfg.cache_shape(self.stage.start)[0], int(batch.seq_lens[0]))
        if self.stage.is_last:
            fields |= probe.logit_lens(self.model, outputs, torch.from_numpy(batch.logits_indices),
                                       [t.token_id for t in tokens])
        else:
            self.chan.send_tensor(outputs, self.world_rank + 1)
        self.chan.send_obj(ProbeReport(batch.batch_id, self.stage.rank, **fields), comm.DRIVER)

    def report(self) -> StageReport:
        events = None
        if self.events is not None:  # each report hands over the events recorded since the last one
            events, self.events = list(self.events), deque(maxlen=MAX_EVENTS)
        return StageReport(
            rank=self.stage.rank, description=self.stage.describe(), pid=os.getpid(),
            param_names=[n for n, _ in self.model.named_parameters()],
            checkpoint_tensors=self.checkpoint_tensors, model_dir=self.args.model_dir,
            num_kv_caches=sum(c is not None for c in self.kv_caches),
            kv_cache_shape=tuple(self.attention_caches[0].k.shape) if self.attention_caches else (),
            num_threads=torch.get_num_threads(),
            cpu_affinity=sorted(os.sched_getaffinity(0)), steps=self.steps,
            activation_bytes_sent=self.bytes_sent, activation_tokens_sent=self.tokens_sent, busy_s=self.busy_s,
            weight_bytes=weight_bytes(self.model),
            kv_cache_bytes=sum(c.nbytes for c in self.kv_caches if c is not None),
            rss_bytes=_resident_bytes(), events=events, clock_offset_s=time.time() - time.perf_counter(),
            device=str(self.device))


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
