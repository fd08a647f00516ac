"""An asyncio front end over LLMEngine: one background thread steps the engine, asyncio tasks await their requests.

The engine is not thread-safe, so every engine call happens on that one thread. Requests and aborts reach it through a
thread-safe queue; per-request token updates come back to the event loop with one call_soon_threadsafe per step.
"""
import asyncio
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from pipellm.engine.detokenizer import StreamText
from pipellm.engine.engine import LLMEngine
from pipellm.loader.model_folder import load_tokenizer
from pipellm.lora import LoRARequest
from pipellm.outputs import Logprob
from pipellm.pipeline.launch import describe_exit
from pipellm.sampling_params import SamplingParams

_IDLE_WAIT_S = 0.5          # an idle engine thread sleeps on its queue this long, then checks the stages
_REPORT_EVERY_S = 2.0       # stage reports (busy seconds, bytes sent) are refreshed at most this often...
_REPORT_FORCED_S = 15.0     # ...and under load at least this often (draining the pipeline for it costs a bubble)


class EngineDeadError(RuntimeError):
    """The pipeline failed; no request can run any more."""


class RequestFailedError(RuntimeError):
    """A stage failed twice while this request ran, the second time with no other suspect out: it was dropped so
    that the other requests could go on (Scheduler.drop_suspects)."""


class RequestRefusedError(ValueError):
    """The engine refused the request as it reached it (checked on the event loop already, the state changed since:
    its LoRA adapter was replaced, say)."""


# ---- messages between the event loop and the engine thread ---------------------------------------------------

@dataclass
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    updates: asyncio.Queue          # receives list[EngineDelta] per step, or an EngineDeadError
    priority: int = 0
    lora_request: LoRARequest | None = None


@dataclass
class AbortRequest:
    request_id: str


@dataclass
class Call:
    """fn(engine) on the engine thread, between steps; its result or exception goes to done."""
    fn: Callable
    done: asyncio.Future


@dataclass
class Stop:
    pass


@dataclass
class EngineDelta:
    """What one completion got in one step: only the new tokens."""
    index: int
    token_ids: list[int]
    text: str                                       # the text they completed (the engine's detokenizer)
    token_times: list[float]                        # time.monotonic() of each new token
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    stop_reason: int | str | None
    stop_text: str | None                           # the text cut before a stop string, when one ended it
    prompt_logprobs: list | None = None             # with the first delta, when asked for: per prompt token


@dataclass
class EngineStats:
    """A snapshot the engine thread writes after each step, for /metrics."""
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0                     # fraction of KV blocks in use
    prefix_cache_hit_rate: float = 0.0
    num_generated_tokens: int = 0                   # all tokens the engine generated, aborted requests' too
    num_restarts: int = 0                           # pipelines started anew after a stage failed
    stage_reports: list = field(default_factory=list)  # list[StageReport]: every 2 s idle, 15 s under load
    num_draft_tokens: int = 0                       # speculative decoding: drafts run
    num_accepted_tokens: int = 0                    # and drafts kept
    loras: tuple[int, str, str] | None = None       # enable_lora: (max_loras, the adapters of running requests, of
    #                                                 waiting ones: names joined by commas)


@dataclass
class StreamDelta:
    """What one completion's client sees: new text that will not be taken back, and its tokens."""
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # in the first delta, when asked for


# ---- the engine thread ----------------------------------------------------------------------------------------

@dataclass
class _Tracked:
    updates: asyncio.Queue
    num_sent: list[int]             # per completion: output tokens already published
    num_chars: list[int]            # per completion: characters of its text already published
    is_open: list[bool]             # per completion: not finished yet


class AsyncEngine:
    """Steps an LLMEngine on a thread of its own; with restart_on_failure on, restarts a failed pipeline there."""

    def __init__(self, engine: LLMEngine, metrics=None):
        self.engine, self.metrics = engine, metrics
        # A tokenizer of our own for the event loop: HF fast tokenizers are not safe to share between threads.
        self.tokenizer = load_tokenizer(engine.model_dir)
        self.stats = EngineStats()
        self.error: str | None = None            # set once when the pipeline fails
        self._commands: queue.Queue = queue.Queue()
        self._active: dict[str, _Tracked] = {}   # engine thread only
        self._last_report = 0.0
        self._has_stepped = True                 # since the last stage report; an idle server asks nothing
        self._num_queued = 0                     # sequences put on the command queue, not yet in the scheduler
        self._queued_lock = threading.Lock()     # ... counted up by the event loop, down by the engine thread
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="pipellm-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Ends every request (finish_reason "abort") and the engine thread. The caller shuts the engine down."""
        if self._thread is not None and self._thread.is_alive():
            self._commands.put(Stop())
            self._thread.join(timeout_s)

    def stage_status(self) -> list[dict]:
        return self.engine.executor.stage_status()  # safe from any thread

    def is_alive(self) -> bool:
        return self.error is None and self.engine.executor.is_alive()

    def dead_reason(self) -> str | None:
        """None while the pipeline works; else why not (the engine thread may not have noticed yet)."""
        if self.is_alive():
            return None
        if self.error is None and self.engine.restarting:
            return f"restarting the pipeline after: {self.engine.restarting}"
        return self.error or _describe_dead(self.stage_status())

    def num_waiting_seqs(self) -> int:
        """Sequences not running yet: on their way to the engine thread, or waiting in its scheduler."""
        return self._num_queued + len(self.engine.scheduler.waiting)  # len() of the deque: atomic under the GIL

    # ---- event loop side ------------------------------------------------------------------------------------

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       priority: int = 0,
                       lora_request: LoRARequest | None = None) -> AsyncIterator[list[StreamDelta]]:
        """Yields the new text of the request's completions as it comes. Closing the iterator early (a client that
        went away) aborts the request, which frees its KV blocks."""
        if self.error:
            raise EngineDeadError(self.error)
        arrival = time.monotonic()
        updates: asyncio.Queue = asyncio.Queue()
        texts = [StreamText(params.stop) for _ in range(params.n)]
        last_time: list[float | None] = [None] * params.n  # per completion: its latest token's time
        is_open = [True] * params.n
        with self._queued_lock:
            self._num_queued += params.n
        self._commands.put(AddRequest(request_id, prompt_token_ids, params, updates, priority, lora_request))
        if self.metrics:
            self.metrics.on_request(len(prompt_token_ids))
        try:
            while any(is_open):
                items = [await updates.get()]
                while not updates.empty():  # a slow reader gets fewer, larger chunks
                    items.append(updates.get_nowait())
                out: dict[int, StreamDelta] = {}
                for item in items:
                    if isinstance(item, Exception):
                        raise item
                    for d in item:
                        if not is_open[d.index]:
                            continue
                        is_open[d.index] = d.finish_reason is None
                        text = texts[d.index].add(d.text, not is_open[d.index], d.stop_text)
                        if self.metrics:
                            self.metrics.on_delta(d.token_times, last_time[d.index], arrival, d.finish_reason)
                        if d.token_times:
                            last_time[d.index] = d.token_times[-1]
                        _merge(out, d, text)
                yield list(out.values())
        finally:
            if any(is_open):
                self._commands.put(AbortRequest(request_id))
                if self.metrics:
                    for _ in range(sum(is_open)):
                        self.metrics.on_delta([], None, arrival, "abort")

    async def call(self, fn: Callable, timeout_s: float = 30.0):
        """fn(engine) run on the engine thread, in order with the requests queued before it (the engine's state is
        that thread's). Returns its result or raises its exception; TimeoutError if the thread does not get to it."""
        done = asyncio.get_running_loop().create_future()
        self._commands.put(Call(fn, done))
        return await asyncio.wait_for(done, timeout_s)

    # ---- engine thread ----------------------------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        while True:
            busy = self.error is None and (engine.has_unfinished_requests() or bool(engine.in_flight))
            for cmd in self._take_commands(block=not busy):
                if isinstance(cmd, Stop):
                    return self._end_all(None)
                self._handle(cmd)
            if self.error is not None:
                continue
            try:
                engine.check_pipeline()  # also noticed while idle, so /health and new requests see it
                if engine.has_unfinished_requests() or engine.in_flight:
                    self._publish(engine.step())
                    self._has_stepped = True
                self._report_dropped()
                self._refresh_stats()
            except Exception as e:  # the pipeline failed (PipelineError), or a bug: stop serving, say why
                self._fail(f"{type(e).__name__}: {e}")

    def _take_commands(self, block: bool) -> list:
        cmds = []
        try:
            if block:  # idle: sleep on the queue, never spin; the cores belong to the stages
                cmds.append(self._commands.get(timeout=_IDLE_WAIT_S))
            while True:
                cmds.append(self._commands.get_nowait())
        except queue.Empty:
            return cmds

    def _handle(self, cmd) -> None:
        if isinstance(cmd, Call):
            try:
                result, error = cmd.fn(self.engine), None
            except Exception as e:
                result, error = None, e
            return self._loop.call_soon_threadsafe(_settle, cmd.done, result, error)
        if isinstance(cmd, AbortRequest):
            if self._active.pop(cmd.request_id, None) is not None:
                self.engine.abort_request(cmd.request_id)
            return
        try:
            if self.error is not None:
                return self._send([(cmd.updates, EngineDeadError(self.error))])
            try:
                self.engine.add_request(cmd.request_id, cmd.prompt_token_ids, cmd.params, cmd.priority,
                                        cmd.lora_request)
            except ValueError as e:  # validated on the event loop already; a duplicate id would land here
                return self._send([(cmd.updates, RequestRefusedError(str(e)))])
        finally:
            with self._queued_lock:  # after add_request: counted in the scheduler now, never in neither
                self._num_queued -= cmd.params.n
        n = cmd.params.n
        self._active[cmd.request_id] = _Tracked(cmd.updates, [0] * n, [0] * n, [True] * n)

    def _publish(self, updated: list) -> None:
        per_request: dict[str, list[EngineDelta]] = {}
        for req in updated:
            rid = req.parent_id or req.request_id
            tracked = self._active.get(rid)
            if tracked is None:
                continue
            start, chars = tracked.num_sent[req.index], tracked.num_chars[req.index]
            text = self.engine.outputs.text(req)
            tracked.num_sent[req.index], tracked.num_chars[req.index] = len(req.output_token_ids), len(text)
            tracked.is_open[req.index] = not req.is_finished
            per_request.setdefault(rid, []).append(EngineDelta(
                req.index, req.output_token_ids[start:], text[chars:], req.token_times[start:],
                req.output_logprobs[start:] if req.params.logprobs is not None else None,
                req.finish_reason, req.stop_reason, req.text if isinstance(req.stop_reason, str) else None,
                req.prompt_logprobs if start == 0 else None))
        batch = []
        for rid, deltas in per_request.items():
            tracked = self._active[rid]
            batch.append((tracked.updates, deltas))
            if not any(tracked.is_open):  # every completion finished: the engine can forget the request
                del self._active[rid]
                self.engine.abort_request(rid)
        self._send(batch)

    def _report_dropped(self) -> None:
        batch = []
        for req, failure in self.engine.dropped:
            rid = req.parent_id or req.request_id
            if (tracked := self._active.pop(rid, None)) is not None:
                self.engine.abort_request(rid)  # its other completions too
                batch.append((tracked.updates, RequestFailedError(
                    f"a stage failed twice while this request ran, the second time with no other request under "
                    f"suspicion: it was dropped so that the others could go on ({failure})")))
        self.engine.dropped.clear()
        self._send(batch)

    def _send(self, batch: list) -> None:
        if batch:  # one wake-up of the event loop per step, not one per request
            self._loop.call_soon_threadsafe(_deliver, batch)

    def _refresh_stats(self) -> None:
        engine, bm = self.engine, self.engine.block_manager
        reports = self.stats.stage_reports
        age = time.monotonic() - self._last_report
        if self._has_stepped and (age >= _REPORT_FORCED_S or (age >= _REPORT_EVERY_S and not engine.in_flight)):
            while engine.in_flight:  # inspect() needs an empty pipeline: let the batches out, submit no more
                self._publish(engine.step(fill=False))
            reports, self._last_report, self._has_stepped = engine.inspect(), time.monotonic(), False
        sched = engine.scheduler
        # Replaced whole, never mutated: the event loop reads it without a lock.
        loras = None
        if engine.adapters is not None:
            names = [",".join(sorted({r.lora_request.lora_name for r in reqs if r.lora_request is not None}))
                     for reqs in (sched.running, sched.waiting)]
            loras = (engine.config.max_loras, *names)
        self.stats = EngineStats(len(sched.running), len(sched.waiting), bm.usage,
                                 bm.prefix_hit_rate, engine.num_generated_tokens, len(engine.restarts), reports,
                                 engine.num_draft_tokens, engine.num_accepted_tokens, loras)

    def _fail(self, message: str) -> None:
        self.error = message
        self._end_all(EngineDeadError(message))
        self.engine.shutdown()  # stop the stages still alive; /health reports 503 from now on

    def _end_all(self, error: Exception | None) -> None:
        """Ends every request: with the error, or (on stop) as finished with finish_reason "abort"."""
        if error is None:
            self.error = "the server is shutting down"
        batch = []
        for rid, tracked in self._active.items():
            if error is None:
                self.engine.abort_request(rid)
                batch.append((tracked.updates, [EngineDelta(i, [], "", [], None, "abort", None, None)
                                                for i, is_open in enumerate(tracked.is_open) if is_open]))
            else:
                batch.append((tracked.updates, error))
        self._active.clear()
        self._send(batch)

def _describe_dead(stages: list[dict]) -> str:
    return "; ".join(f"stage {s['rank']} (pid {s['pid']}) {describe_exit(s['returncode'])}" for s in stages
                     if s["returncode"] is not None) or "the pipeline failed"


def _deliver(batch: list) -> None:
    for updates, item in batch:
        updates.put_nowait(item)


def _settle(done: asyncio.Future, result, error: Exception | None) -> None:
    if not done.done():  # the caller may have given up waiting
        done.set_exception(error) if error is not None else done.set_result(result)


def _merge(out: dict[int, StreamDelta], d: EngineDelta, text: str) -> None:
    prev = out.get(d.index)
    if prev is None:
        logprobs = None if d.logprobs is None else list(d.logprobs)
        out[d.index] = StreamDelta(d.index, text, list(d.token_ids), logprobs, d.finish_reason, d.stop_reason,
                                   d.prompt_logprobs)
        return
    prev.text += text
    prev.token_ids += d.token_ids
    if prev.logprobs is not None:
        prev.logprobs += d.logprobs
    prev.finish_reason, prev.stop_reason = d.finish_reason, d.stop_reason
