"""The stage process: holds a contiguous range of layers, their weights and KV caches, and runs batches."""
import ctypes
import json
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass

import torch

from pipellm.config import EngineConfig, ModelConfig
from pipellm.loader.safetensors import load_stage_weights
from pipellm.models.layers import AttentionMetadata, transpose_linears
from pipellm.models.registry import build_stage_model
from pipellm.pipeline import comm
from pipellm.pipeline.messages import Inspect, SampledBatch, Shutdown, StageBatch, StageReport
from pipellm.pipeline.partition import StageLayers
from pipellm.sampler import Sampler


@dataclass
class StageArgs:
    stage: StageLayers
    num_stages: int
    model_dir: str
    model_config: ModelConfig
    engine_config: EngineConfig
    num_blocks: int
    cores: list[int]                 # CPU cores this stage pins itself to
    master_addr: str
    master_port: int

MAX_EVENTS = 200_000  # trace events a stage keeps between two reports


HEARTBEAT_S = 0.5  # how often a stage tells the driver it is still there


def heartbeat_key(rank: int) -> str:
    return f"heartbeat/{rank}"


def _heartbeat(args: StageArgs) -> None:
    """Stamps the wall clock into the store twice a second. It stops when the process stops (SIGSTOP, a hang
    in native code that holds the GIL, death), which is how the driver tells a hung stage from a slow one."""
    store = comm.make_store(args.master_addr, args.master_port, args.num_stages + 1, is_master=False)
    while True:
        store.set(heartbeat_key(args.stage.rank), repr(time.time()))
        time.sleep(HEARTBEAT_S)


def ready_key(rank: int) -> str:
    return f"ready/{rank}"


def error_key(rank: int) -> str:
    return f"error/{rank}"


class StageWorker:
    def __init__(self, args: StageArgs):
        self.args, self.stage = args, args.stage
        cfg, ecfg = args.model_config, args.engine_config
        self.model = build_stage_model(cfg, self.stage)
        self.checkpoint_tensors = load_stage_weights(self.model, args.model_dir, ecfg.torch_dtype)
        transpose_linears(self.model)
        self.model.eval()
        shape = (args.num_blocks, ecfg.block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=ecfg.torch_dtype), torch.zeros(shape, dtype=ecfg.torch_dtype))
                          for _ in range(self.stage.num_layers)]
        self.sampler = Sampler() if self.stage.is_last else None
        self.steps = self.bytes_sent = self.tokens_sent = 0
        self.busy_s = 0.0  # time computing, not waiting for input
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
            msg = chan.recv_obj(comm.DRIVER)
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
        t = torch.from_numpy
        positions = t(batch.positions)
        meta = AttentionMetadata.build(positions, t(batch.query_lens), t(batch.seq_lens), t(batch.block_tables),
                                       t(batch.slot_mapping), ecfg.block_size, cfg.sliding_window)
        if self.stage.is_first:
            x = t(batch.input_ids)
        else:
            waiting_since = time.perf_counter()
            x = self.chan.recv_tensor((batch.num_tokens, cfg.hidden_size), ecfg.torch_dtype,
                                      self.world_rank - 1)
            self._record("wait_hidden", batch, waiting_since)
        start = time.perf_counter()
        hidden = self.model(x, positions, meta, self.kv_caches)
        self.steps += 1
        if not self.stage.is_last:
            self.busy_s += time.perf_counter() - start
            self._record("forward", batch, start)
            self.chan.send_tensor(hidden, self.world_rank + 1)
            self.bytes_sent += hidden.numel() * hidden.element_size()
            self.tokens_sent += hidden.shape[0]
            return
        for req_id in batch.finished_req_ids:
            self.sampler.remove_request(req_id)
        for req in batch.new_requests:
            self.sampler.add_request(req.req_id, req.params, req.prompt_token_ids, req.seed)
        tokens = []
        if len(batch.logits_indices):
            logits = self.model.compute_logits(hidden[t(batch.logits_indices)])
            tokens = self.sampler.sample(logits, batch.sample_req_ids)
        self.busy_s += time.perf_counter() - start
        self._record("forward", batch, start)
        self.chan.send_obj(SampledBatch(batch.batch_id, tokens), comm.DRIVER)

    def report(self) -> StageReport:
        events = None
        if self.events is not None:  # each report hands over the events recorded since the last one
            events, self.events = list(self.events), deque(maxlen=MAX_EVENTS)
        return StageReport(
            rank=self.stage.rank, description=self.stage.describe(), pid=os.getpid(),
            param_names=[n for n, _ in self.model.named_parameters()],
            checkpoint_tensors=self.checkpoint_tensors, num_kv_caches=len(self.kv_caches),
            kv_cache_shape=tuple(self.kv_caches[0][0].shape), num_threads=torch.get_num_threads(),
            cpu_affinity=sorted(os.sched_getaffinity(0)), steps=self.steps,
            activation_bytes_sent=self.bytes_sent, activation_tokens_sent=self.tokens_sent, busy_s=self.busy_s,
            events=events, clock_offset_s=time.time() - time.perf_counter())


def _die_with_parent() -> None:
    # Linux: SIGKILL this process when the driver dies, however it dies.
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def stage_main(args: StageArgs) -> None:
    """Entry point of a stage process."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle; it shuts us down
    os.sched_setaffinity(0, args.cores)
    torch.set_num_threads(args.engine_config.num_threads)
    rank = args.stage.rank
    store = None
    try:
        store = comm.make_store(args.master_addr, args.master_port, args.num_stages + 1, is_master=False)
        worker = StageWorker(args)
        store.set(heartbeat_key(rank), repr(time.time()))  # the first one before ready: the driver reads it next
        threading.Thread(target=_heartbeat, args=(args,), name="pipellm-heartbeat", daemon=True).start()
        store.set(ready_key(rank), "1")
        worker.serve(comm.make_channel(store, comm.stage_world_rank(rank), args.num_stages + 1))
    except BaseException as e:  # report any failure where the driver looks for it, then exit non-zero
        if store is not None:
            try:
                store.set(error_key(rank), json.dumps({"type": type(e).__name__, "message": str(e),
                                                       "traceback": traceback.format_exc()}))
            except Exception:
                pass
        os._exit(1)
    os._exit(0)  # skip interpreter teardown: gloo's destructors can block on peers that already left



def main_from_stdin() -> None:
    stage_main(pickle.loads(sys.stdin.buffer.read()))
