"""Driver side of the pipeline: starts the stage processes, sends them batches and collects sampled tokens."""
import json
import os
import pickle
import select
import subprocess
import sys
import threading
import time
from dataclasses import replace
from datetime import timedelta

from pipellm.config import EngineConfig, ModelConfig
from pipellm.pipeline import comm
from pipellm.pipeline.messages import Inspect, SampledBatch, Shutdown, StageBatch, StageReport
from pipellm.pipeline.partition import StageLayers
from pipellm.pipeline.stage import HEARTBEAT_S, StageArgs, error_key, heartbeat_key, ready_key


STAGE_ENTRY = "from pipellm.pipeline.stage import main_from_stdin; main_from_stdin()"


class PipelineError(RuntimeError):
    """A stage died, failed or stopped answering. The message names the stage."""


def stage_cores(num_stages: int, threads: int) -> list[list[int]]:
    cores = sorted(os.sched_getaffinity(0))
    return [[cores[(rank * threads + i) % len(cores)] for i in range(threads)] for rank in range(num_stages)]


class PipelineExecutor:
    def __init__(self, model_dir: str, model_config: ModelConfig, engine_config: EngineConfig,
                 stages: list[StageLayers], num_blocks: int, start_timeout_s: float = 300.0):
        self.stages = stages
        self.step_timeout = timedelta(seconds=engine_config.step_timeout_s)
        self.procs: list[subprocess.Popen] = []
        self.failed: PipelineError | None = None
        self.first_death: int | None = None  # rank of the stage that died first (set by the watchdog)
        self.hung = False                     # ... or stopped answering: its heartbeat went silent
        self.heartbeat_timeout_s = engine_config.heartbeat_timeout_s
        world_size = len(stages) + 1
        self.store = comm.make_store("127.0.0.1", 0, world_size, is_master=True)
        cores = stage_cores(len(stages), engine_config.num_threads)
        try:
            for stage in stages:
                args = StageArgs(stage, len(stages), model_dir, model_config, engine_config, num_blocks,
                                 cores[stage.rank], "127.0.0.1", self.store.port)
                # A fresh interpreter running the stage module: unlike multiprocessing's spawn, it does not
                # re-import the user's script, so scripts need no `if __name__ == "__main__"` guard.
                proc = subprocess.Popen([sys.executable, "-c", STAGE_ENTRY], stdin=subprocess.PIPE)
                self.procs.append(proc)
                proc.stdin.write(pickle.dumps(args))
                proc.stdin.close()
            self._wait_ready(start_timeout_s)
            self.chan = comm.make_channel(self.store, comm.DRIVER, world_size)
        except BaseException:
            self._kill()
            raise
        self._closing = False
        self._wake_r, self._wake_w = os.pipe()
        threading.Thread(target=self._watch, name="pipellm-stage-watchdog", daemon=True).start()

    def _watch(self) -> None:
        """Waits for a stage process to end or to miss its heartbeats. If that was not a shutdown, stops every
        stage: their sockets close, so whatever the driver waits on fails at once instead of hanging (a gloo
        receive from a peer that died before it was posted may otherwise never return)."""
        fds = {os.pidfd_open(p.pid): rank for rank, p in enumerate(self.procs)}
        store = comm.make_store("127.0.0.1", self.store.port, len(self.stages) + 1, is_master=False)  # own client
        try:
            while not self._closing:
                ready, _, _ = select.select(list(fds) + [self._wake_r], [], [], HEARTBEAT_S)
                dead = [fds[fd] for fd in ready if fd in fds]
                now = time.time()
                silent = [rank for rank in range(len(self.stages))
                          if now - float(store.get(heartbeat_key(rank))) > self.heartbeat_timeout_s]
                if self._closing or not (dead or silent):
                    continue
                self.first_death = (dead or silent)[0]
                self.hung = not dead
                self._kill()
                return
        finally:
            for fd in [*fds, self._wake_r]:
                os.close(fd)

    @property
    def last_rank(self) -> int:
        return comm.stage_world_rank(len(self.stages) - 1)

    def _wait_ready(self, timeout_s: float) -> None:
        # Stages load their weights in parallel; watch for readiness, a reported error, or a death.
        deadline = time.monotonic() + timeout_s
        pending = set(range(len(self.stages)))
        while pending:
            for rank in list(pending):
                if self.store.check([error_key(rank)]):
                    raise self._stage_error(rank)
                if self.store.check([ready_key(rank)]):
                    pending.discard(rank)
                elif self.procs[rank].poll() is not None:
                    raise self._diagnose(f"stage {rank} exited while loading")
            if time.monotonic() > deadline:
                raise PipelineError(f"stages {sorted(pending)} did not finish loading within {timeout_s:.0f} s")
            self._wait_any_exit(0.05)

    def _stage_error(self, rank: int) -> Exception:
        err = json.loads(self.store.get(error_key(rank)))
        msg = f"stage {rank}: {err['type']}: {err['message']}"
        # Bad input reported by a stage (a missing tensor, a bad file) stays a ValueError for the user.
        return ValueError(msg) if err["type"] in ("ValueError", "FileNotFoundError") else PipelineError(
            f"{msg}\n{err['traceback']}")

    def _diagnose(self, what: str) -> PipelineError:
        """Names the stages that died or reported an error. Waits briefly so a failure can propagate."""
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and all(p.poll() is None for p in self.procs):
            self._wait_any_exit(0.1)
        problems = []
        first = self.first_death
        for rank, proc in enumerate(self.procs):
            if first is not None and rank != first and not self.store.check([error_key(rank)]):
                continue  # stopped by the watchdog, not a cause
            if rank == first and self.hung:
                problems.append(f"stage {rank} (pid {proc.pid}) stopped answering: no heartbeat for "
                                f"{self.heartbeat_timeout_s:.0f} s")
                continue
            if self.store.check([error_key(rank)]):
                err = json.loads(self.store.get(error_key(rank)))
                problems.append(f"stage {rank} (pid {proc.pid}) failed: {err['type']}: {err['message']}")
            elif proc.poll() is not None:
                code = proc.returncode
                how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
                problems.append(f"stage {rank} (pid {proc.pid}) {how}")
        if first is not None and len(self.procs) > 1:
            problems.append("the other stages were stopped")
        return PipelineError(f"{what}: " + ("; ".join(problems) or "no stage reported a cause"))

    def _guard(self, what: str, fn, *args):
        if self.failed:
            raise self.failed
        try:
            return fn(*args)
        except RuntimeError as e:
            if "Timed out" in str(e):
                self.failed = self._diagnose(f"{what}: no answer within {self.step_timeout.total_seconds():.0f} s")
            else:
                self.failed = self._diagnose(what)
            self._kill()
            raise self.failed from None

    def submit(self, batch: StageBatch) -> None:
        """Sends a batch to every stage without waiting for it to run."""
        def send():
            for stage in self.stages:
                # Each stage gets only what it reads.
                part = replace(batch, input_ids=batch.input_ids if stage.is_first else None)
                if not stage.is_last:
                    part = replace(part, sample_req_ids=[], new_requests=[], finished_req_ids=[])
                self.chan.send_obj(part, comm.stage_world_rank(stage.rank))
        self._guard("sending a batch", send)

    def receive(self) -> SampledBatch:
        """The sampled tokens of the oldest batch in flight."""
        return self._guard("waiting for the pipeline", self.chan.recv_obj, self.last_rank, self.step_timeout)

    def inspect(self) -> list[StageReport]:
        def ask():
            for stage in self.stages:
                self.chan.send_obj(Inspect(), comm.stage_world_rank(stage.rank))
            return [self.chan.recv_obj(comm.stage_world_rank(s.rank), self.step_timeout) for s in self.stages]
        return self._guard("inspecting the stages", ask)

    def is_alive(self) -> bool:
        return not self.failed and all(p.poll() is None for p in self.procs)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        self._closing = True
        if hasattr(self, "_wake_w") and self._wake_w >= 0:
            try:
                os.write(self._wake_w, b"x")  # stops the watchdog
            except OSError:
                pass  # it stopped already
            os.close(self._wake_w)
            self._wake_w = -1
        if self.is_alive() and hasattr(self, "chan"):
            try:
                for stage in self.stages:
                    self.chan.send_obj(Shutdown(), comm.stage_world_rank(stage.rank))
                self.chan.flush(timedelta(seconds=timeout_s))
            except RuntimeError:
                pass
            deadline = time.monotonic() + timeout_s
            for proc in self.procs:
                try:
                    proc.wait(max(0.01, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        self._kill()

    def _wait_any_exit(self, timeout_s: float) -> None:
        fds = [os.pidfd_open(p.pid) for p in self.procs if p.poll() is None]
        try:
            select.select(fds, [], [], timeout_s)
        finally:
            for fd in fds:
                os.close(fd)

    def _kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            proc.wait()
