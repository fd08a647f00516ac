"""A stage that dies mid-generation: without recovery the user gets an error naming it within 5 s; with
restart_on_failure the engine starts a new pipeline and every request ends as if nothing had happened."""
import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
import types

import httpx
import pytest

from benchmarks.soak import free_port
from pipellm import LLM, SamplingParams
from pipellm.pipeline import executor as executor_module
from pipellm.pipeline.executor import PipelineError, PipelineExecutor
from tests.conftest import FP32
from tests.serving import is_running, serve

PROMPTS = [{"prompt_token_ids": [i % 300 + 1, 7, (3 * i) % 250 + 2] * (2 + i % 5)} for i in range(24)]
# Greedy, and seeded random draws with penalties: both must come out the same after a restart.
PARAMS = [SamplingParams(max_tokens=48, ignore_eos=True, temperature=0.0) if i % 3 else
          SamplingParams(max_tokens=48, ignore_eos=True, temperature=0.9, seed=i, repetition_penalty=1.3,
                         frequency_penalty=0.2) for i in range(len(PROMPTS))]


class KillWhen(threading.Thread):
    """Kills a stage of llm's current pipeline once some request has `after_tokens` output tokens."""

    def __init__(self, llm: LLM, rank: int, after_tokens: int = 6):
        super().__init__(daemon=True)
        self.llm, self.rank, self.after_tokens = llm, rank, after_tokens
        self.killed_at: float | None = None
        self.progress: list[int] = []    # output lengths at the kill
        self.stop = threading.Event()

    def run(self):
        executor = self.llm.engine.executor
        while not self.stop.is_set():
            lengths = [len(r.output_token_ids) for r in list(self.llm.engine.requests.values())]
            if lengths and max(lengths) >= self.after_tokens:
                self.progress = lengths
                os.kill(executor.procs[self.rank].pid, signal.SIGKILL)
                self.killed_at = time.monotonic()
                return
            time.sleep(0.002)


def _token_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def recovering_llm(llama_dir):
    with LLM(llama_dir, pipeline_parallel_size=2, restart_on_failure=True, dtype=FP32) as llm:
        yield llm


def test_a_stage_reaped_by_the_watchdog_while_the_driver_looks_counts_as_exited(monkeypatch):
    """The driver's wait for an exit polls a stage, then the watchdog (stopping every stage) reaps it before the
    driver opens its pidfd: an exit, not a ProcessLookupError that would kill the engine."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    executor = PipelineExecutor.__new__(PipelineExecutor)  # only its process table: no stages to start
    executor.procs = {0: proc}
    real_open = os.pidfd_open

    def reaped_first(pid):
        proc.kill()
        proc.wait()  # the watchdog's _kill, between poll() and pidfd_open()
        return real_open(pid)

    monkeypatch.setattr(executor_module.os, "pidfd_open", reaped_first)
    start = time.monotonic()
    executor._wait_any_exit(5.0)
    assert time.monotonic() - start < 1.0 and proc.returncode is not None


class _Exited:
    def __init__(self, pid: int, code: int):
        self.pid, self.returncode = pid, code

    def poll(self):
        return self.returncode

    def wait(self, timeout=None):
        return self.returncode


def _diagnosed(codes: list[int], errors: dict[int, str], first: int) -> PipelineError:
    """What the executor makes of stages that exited with these codes (first the first to go), those in errors
    having reported that exception."""
    executor = PipelineExecutor.__new__(PipelineExecutor)  # only what _diagnose reads: no stages to start
    executor.stages, executor.first_death, executor.hung, executor.info = [None] * len(codes), first, False, {}
    executor.procs = {rank: _Exited(100 + rank, code) for rank, code in enumerate(codes)}
    reports = {f"error/{rank}": json.dumps({"type": "RuntimeError", "message": msg, "traceback": ""})
               for rank, msg in errors.items()}
    executor.store = types.SimpleNamespace(trusted=reports.get)
    return executor._diagnose("waiting for the pipeline")


def test_only_a_stage_s_own_fault_puts_the_batches_out_under_suspicion():
    """A stage killed from outside makes the next one fail on its closed connection: that is not raised (the
    requests out are re-run, not suspected); an error a stage raised, or a crash, is."""
    killed = _diagnosed([-signal.SIGKILL, 1], {1: "Connection closed by peer"}, first=0)
    assert "stage 0 (pid 100) was killed by signal 9" in str(killed) and not killed.raised
    assert _diagnosed([1, -signal.SIGKILL], {0: "WireError: malformed"}, first=0).raised
    assert _diagnosed([-signal.SIGSEGV, -signal.SIGKILL], {}, first=0).raised
    assert not _diagnosed([3, -signal.SIGKILL], {}, first=0).raised  # exited without a word


def test_restart_gives_every_request_the_tokens_of_a_fault_free_run(recovering_llm):
    llm = recovering_llm
    expected = _token_ids(llm.generate(PROMPTS, PARAMS, use_tqdm=False))
    for rank in (1, 0):  # the last stage holds the sampling state; the first one the embedding
        old_pids = [p.pid for p in llm.engine.executor.procs.values()]
        killer = KillWhen(llm, rank)
        killer.start()
        got = _token_ids(llm.generate(PROMPTS, PARAMS, use_tqdm=False))
        killer.stop.set()
        assert killer.killed_at is not None, "the generation ended before the kill"
        assert 0 < max(killer.progress) < 48, "the kill did not land mid-generation"
        restart = llm.engine.restarts[-1]
        assert f"stage {rank} (pid {old_pids[rank]}) was killed by signal 9" in restart["error"]
        assert restart["detected_at"] - killer.killed_at < 5.0
        assert got == expected
        assert not any(map(is_running, old_pids)), "a stage of the failed pipeline is still running"
    assert len(llm.engine.restarts) == 2
    assert llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks


def test_without_restart_the_error_names_the_stage_within_5_s(llama_dir):
    llm = LLM(llama_dir, pipeline_parallel_size=2, dtype=FP32)
    pids = [p.pid for p in llm.engine.executor.procs.values()]
    killer = KillWhen(llm, 1)
    killer.start()
    try:
        with pytest.raises(PipelineError, match=r"stage 1 \(pid \d+\) was killed by signal 9"):
            llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        assert killer.killed_at is not None and time.monotonic() - killer.killed_at < 5.0
    finally:
        killer.stop.set()
        llm.shutdown()
    assert not any(map(is_running, pids))


def test_a_stage_that_keeps_dying_stops_the_restarts(llama_dir):
    llm = LLM(llama_dir, pipeline_parallel_size=2, restart_on_failure=True, dtype=FP32)
    pids = []

    def keep_killing():
        for generation in range(3):
            while llm.engine.executor.generation != generation or not llm.engine.executor.is_alive():
                time.sleep(0.01)
            pids.extend(p.pid for p in llm.engine.executor.procs.values())
            os.kill(llm.engine.executor.procs[0].pid, signal.SIGKILL)

    killer = threading.Thread(target=keep_killing, daemon=True)
    killer.start()
    try:
        with pytest.raises(PipelineError, match=r"stage 0 .* was killed by signal 9(.|\n)*failed 3 times within 60 s"):
            llm.generate(PROMPTS * 8, SamplingParams(max_tokens=200, ignore_eos=True), use_tqdm=False)
    finally:
        killer.join(30)
        llm.shutdown()
    assert len(llm.engine.restarts) == 2
    assert not any(map(is_running, pids))


def test_a_request_a_stage_fails_on_every_time_is_dropped_and_the_others_go_on(llama_dir):
    """A request whose input makes a stage raise each time it runs would fail every new pipeline too, and the
    restart limit would end the engine for every request: after it fails again while it is the only suspect out, it
    ends with finish_reason "abort", and the others finish as in a fault-free run."""
    poison = SamplingParams(max_tokens=8)
    poison.ignore_eos = "yes"  # set past SamplingParams' checks: the stages' own checks raise on it
    with LLM(llama_dir, pipeline_parallel_size=2, restart_on_failure=True, dtype=FP32) as llm:
        expected = _token_ids(llm.generate(PROMPTS[:6], PARAMS[:6], use_tqdm=False))
        outs = llm.generate(PROMPTS[:3] + [PROMPTS[6]] + PROMPTS[3:6], PARAMS[:3] + [poison] + PARAMS[3:6],
                            use_tqdm=False)
        assert outs[3].outputs[0].finish_reason == "abort" and not outs[3].outputs[0].token_ids
        assert _token_ids(outs[:3] + outs[4:]) == expected
        assert len(llm.engine.restarts) == 2  # the failure with it among others, then the one with it alone
        assert all("SamplingParams.ignore_eos: expected true/false" in r["error"] for r in llm.engine.restarts)
        assert llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks


STORIES = [f"Story number {i}: once upon a time" for i in range(6)]


async def _stream_all(server, kill_after_chunks: int | None = None) -> tuple[list[str], list[dict], float | None]:
    """Streams a greedy completion per story at once; SIGKILLs stage 1 once that many chunks have arrived.
    Returns each stream's text, the error events seen, and when the kill happened."""
    victim = server.stage_pids()[1]
    state = {"chunks": 0, "killed_at": None}
    errors = []

    async def one(client, prompt):
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 40, "temperature": 0.0, "ignore_eos": True,
                "stream": True}
        text = ""
        async with client.stream("POST", f"{server.url}/v1/completions", json=body) as resp:
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    errors.append(event["error"])
                    continue
                text += event["choices"][0]["text"]
                state["chunks"] += 1
                if kill_after_chunks is not None and state["chunks"] == kill_after_chunks:
                    os.kill(victim, signal.SIGKILL)
                    state["killed_at"] = time.monotonic()
        return text

    async with httpx.AsyncClient(timeout=120) as client:
        texts = await asyncio.gather(*(one(client, p) for p in STORIES))
    return list(texts), errors, state["killed_at"]


def test_server_restarts_and_streams_go_on_without_gap_or_duplicate(llama_dir, tmp_path):
    with serve(llama_dir, tmp_path, "--served-model-name", "tiny") as server:  # restart is on by default
        expected, errors, _ = asyncio.run(_stream_all(server))
        assert not errors and all(expected)
        old_pids = server.stage_pids()
        statuses, done = [], threading.Event()

        def poll_health():  # /health during the restart: 503 with the cause, then 200 again
            # until the streams are done and a poll after them answered: on a busy machine the streams may end
            # while this thread still holds the answer of a poll made during the restart
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not (done.is_set() and statuses and statuses[-1][2]):
                after_streams = done.is_set()
                resp = httpx.get(f"{server.url}/health", timeout=10)
                statuses.append((resp.status_code, resp.json()["error"], after_streams))
                time.sleep(0.05)

        poller = threading.Thread(target=poll_health, daemon=True)
        poller.start()
        got, errors, killed_at = asyncio.run(_stream_all(server, kill_after_chunks=8))
        done.set()
        poller.join(30)
        assert killed_at is not None and not errors
        assert any(code == 503 and f"stage 1 (pid {old_pids[1]})" in error for code, error, _ in statuses), statuses
        assert statuses[-1] == (200, None, True)
        assert got == expected  # each stream's text: no token lost or repeated across the restart
        health = httpx.get(f"{server.url}/health").json()
        assert health["status"] == "ok" and set(server.stage_pids()).isdisjoint(old_pids)
        assert not any(map(is_running, old_pids))
        assert any(line.startswith("pipellm:pipeline_restarts_total{") and line.endswith(" 1.0")
                   for line in httpx.get(f"{server.url}/metrics").text.splitlines())


def test_server_without_restart_ends_streams_with_an_error_naming_the_stage(llama_dir, tmp_path):
    with serve(llama_dir, tmp_path, "--served-model-name", "tiny", "--no-restart-on-failure") as server:
        pids = server.stage_pids()
        start = time.monotonic()
        _, errors, killed_at = asyncio.run(_stream_all(server, kill_after_chunks=8))
        assert killed_at is not None and time.monotonic() - killed_at < 5.0, "the streams did not end within 5 s"
        assert errors and all(f"stage 1 (pid {pids[1]}) was killed by signal 9" in e["message"] for e in errors)
        assert httpx.get(f"{server.url}/health").status_code == 503
        assert time.monotonic() - start < 60
    assert not any(map(is_running, pids))


def test_a_lost_host_fails_the_restart_fast_instead_of_waiting(llama_dir, monkeypatch):
    """Host 1 (its `pipellm stage` agent and stage) vanishes: the restart gives up once the agent is silent."""
    port = free_port()
    monkeypatch.setenv("PIPELLM_TOKEN", "test-token-0123456789abcdef")  # the driver's and the agent's
    agent = subprocess.Popen([sys.executable, "-m", "pipellm.entrypoints.cli", "stage", "--nnodes", "2", "--node-rank",
                              "1", "--master-port", str(port), "--connect-timeout", "60"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        llm = LLM(llama_dir, pipeline_parallel_size=2, nnodes=2, master_port=port, restart_on_failure=True,
                  dtype=FP32)
        try:
            pids = [s["pid"] for s in llm.engine.executor.stage_status()]
            os.killpg(agent.pid, signal.SIGKILL)  # the whole host: the agent and its stage
            start = time.monotonic()
            with pytest.raises(PipelineError, match=r"node agent of host 1 .* stopped answering"):
                llm.generate(PROMPTS, PARAMS, use_tqdm=False)
            assert time.monotonic() - start < 15
        finally:
            llm.shutdown()
        assert not any(map(is_running, pids))
    finally:
        agent.kill()
        agent.wait(10)


def test_the_server_s_engine_ends_a_dropped_request_with_its_own_error(llama_dir):
    """Through the server's AsyncEngine: the dropped request's stream raises RequestFailedError (a 500 naming the
    failure), and a request beside it streams to its end."""
    from pipellm.config import EngineConfig
    from pipellm.engine.async_engine import AsyncEngine, RequestFailedError
    from pipellm.engine.engine import LLMEngine

    poison = SamplingParams(max_tokens=8)
    poison.ignore_eos = "yes"
    engine = LLMEngine(EngineConfig(llama_dir, pipeline_parallel_size=2, restart_on_failure=True, dtype=FP32))

    async def run():
        async_engine = AsyncEngine(engine)
        async_engine.start()

        async def tokens(rid, params):
            return [t for deltas in [d async for d in async_engine.generate(rid, [5, 6, 7], params)]
                    for d in deltas for t in d.token_ids]
        try:
            return await asyncio.gather(tokens("good", SamplingParams(max_tokens=8, ignore_eos=True)),
                                        tokens("poison", poison), return_exceptions=True)
        finally:
            async_engine.stop()
    try:
        good, dropped = asyncio.run(run())
    finally:
        engine.shutdown()
    assert len(good) == 8
    assert isinstance(dropped, RequestFailedError) and "it was dropped so that the others could go on" in str(dropped)
    assert "SamplingParams.ignore_eos: expected true/false" in str(dropped)
