"""Driver side of the pipeline: starts the stage processes, sends them batches and collects sampled tokens.

Stages on this host are started here (through launch.py). Stages on other hosts are started there, by a node agent
(`pipellm stage`, pipellm.pipeline.node) or by torchrun; all of them find their work in the driver's rendezvous store.
"""
import json
import os
import select
import signal
import subprocess
import threading
import time
from collections import deque
from dataclasses import replace
from datetime import timedelta

from pipellm.config import EngineConfig
from pipellm.model_config import ModelConfig
from pipellm.pipeline import comm, wire
from pipellm.pipeline.messages import (Inspect, ProbeReport, SampledBatch, Shutdown, StageArgs, StageBatch,
                                       StageReport, num_drafts)
from pipellm.pipeline.launch import describe_exit, stage_env, start_stage
from pipellm.pipeline.partition import StageLayers, node_of_stage


class PipelineError(RuntimeError):
    """A stage died, failed or stopped answering. The message names the stage. raised: a stage raised an error or
    crashed (a fault signal) while it ran, which the batches out may have caused, rather than was killed, exited or
    hung."""

    def __init__(self, message: str, raised: bool = False):
        super().__init__(message)
        self.raised = raised


FAULT_SIGNALS = (signal.SIGILL, signal.SIGABRT, signal.SIGBUS, signal.SIGFPE, signal.SIGSEGV)


class PipelineExecutor:
    def __init__(self, model_dir: str, model_config: ModelConfig, engine_config: EngineConfig,
                 stages: list[StageLayers], num_blocks: int, store: comm.SignedStore, generation: int = 0,
                 num_window_blocks: int = 0,
                 start_timeout_s: float = 300.0):
        self.stages = stages
        self.step_timeout = timedelta(seconds=engine_config.step_timeout_s)
        self.heartbeat_timeout_s = engine_config.heartbeat_timeout_s
        self.failed: PipelineError | None = None
        self.first_death: int | None = None  # rank of the stage that failed first (set by the watchdog)
        self.hung = False                     # ... by going silent: no heartbeat
        self.info: dict[int, dict] = {}       # rank -> {"pid", "host", "device"} once loaded
        self.watching = False                 # the watchdog thread runs
        self._closing = False
        self._store_addr = (store.store.host, store.store.port)
        self.key = store.key
        self.generation = generation
        self.store = store.generation(generation)
        self.vocab_size, self.num_layers = model_config.vocab_size, model_config.num_layers
        self.expected: deque[tuple] = deque()  # per batch in flight: tokens, prompt log-prob rows, top k
        world_size = len(stages) + 1
        self.node_of = [node_of_stage(s.rank, len(stages), engine_config.nnodes) for s in stages]
        local = [s.rank for s in stages
                 if engine_config.distributed_executor_backend == "mp" and self.node_of[s.rank] == 0]
        self.procs: dict[int, subprocess.Popen] = {}  # rank -> process, for the stages started here
        try:
            for stage in stages:
                args = StageArgs(stage, len(stages), model_dir, model_config, engine_config, num_blocks,
                                 num_window_blocks)
                self.store.set(comm.args_key(stage.rank), wire.encode(args))
            store.set(comm.GENERATION_KEY, str(generation))  # the plan is complete: stages may start
            for i, rank in enumerate(local):
                env = stage_env(comm.stage_world_rank(rank), world_size, *self._store_addr, i, len(local), self.key,
                                generation)
                self.procs[rank] = start_stage(env)
            self._wait_ready(start_timeout_s, store)
            self.chan = comm.make_channel(self.store, comm.DRIVER, len(stages), self._store_addr[0],
                                          engine_config.batches_in_flight)
        except BaseException:
            self._kill()
            raise
        self._wake_r, self._wake_w = os.pipe()
        self.watching = True
        self._watchdog = threading.Thread(target=self._watch, name="pipellm-stage-watchdog", daemon=True)
        self._watchdog.start()

    # ---- failure detection ----------------------------------------------------------------------------------

    def _watch(self) -> None:
        """Waits for a stage to end or to miss its heartbeats. If that was not a shutdown, stops every stage: their
        sockets close, so whatever the driver waits on fails at once instead of hanging (a gloo receive from a peer
        that died before it was posted may otherwise never return). Local stages are watched through their
        process handles; stages elsewhere through the exit codes their node agents write, and heartbeats."""
        fds = {os.pidfd_open(p.pid): rank for rank, p in self.procs.items()}
        store = comm.SignedStore(comm.make_store(*self._store_addr, is_master=False), self.key).generation(
            self.generation)
        beats = {rank: (None, time.monotonic()) for rank in range(len(self.stages))}  # last count, when it changed
        waited = False  # once, for the death behind a stage's error

        def reported_error(rank: int) -> bool:
            return store.trusted(comm.error_key(rank)) is not None

        try:
            while not self._closing:
                ready, _, _ = select.select(list(fds) + [self._wake_r], [], [], comm.HEARTBEAT_S)
                if self._closing:
                    return
                dead = [fds[fd] for fd in ready if fd in fds]
                dead += [r for r in range(len(self.stages))
                         if r not in self.procs and store.trusted(comm.exit_key(r)) is not None]
                now, silent = time.monotonic(), []
                for rank, (count, since) in beats.items():
                    new = store.trusted(comm.heartbeat_key(rank))
                    if new != count:
                        beats[rank] = (new, now)
                    elif now - since > self.heartbeat_timeout_s:
                        silent.append(rank)
                if dead and all(map(reported_error, dead)) and not waited:
                    # A stage that failed with an error of its own may only have lost a peer that died: wait one
                    # round for that death to show (a node agent reports a remote one within 0.2 s).
                    waited = True
                    time.sleep(comm.HEARTBEAT_S)
                    continue
                if dead or silent:
                    dead.sort(key=reported_error)  # deaths without an error of their own are the causes
                    self.first_death, self.hung = (dead or silent)[0], not dead
                    self._kill()
                    return
        except Exception:  # the store went away with the driver's shutdown
            if not self._closing:
                raise
        finally:
            self.watching = False
            for fd in [*fds, self._wake_r]:
                os.close(fd)

    def _wait_ready(self, timeout_s: float, base_store: comm.SignedStore) -> None:
        # Stages load their weights in parallel; watch for readiness, a reported error, or a death.
        deadline = time.monotonic() + timeout_s
        pending = set(range(len(self.stages)))
        agents: dict[int, tuple[bytes, float]] = {}  # node -> its agent's last count, when it changed
        while pending:
            for rank in pending - set(self.procs):
                self._check_agent(base_store, self.node_of[rank], agents)
            for rank in list(pending):
                if (error := self.store.trusted(comm.error_key(rank))) is not None:
                    raise self._stage_error(rank, error)
                ready = self.store.trusted(comm.ready_key(rank))  # a forged one is ignored: the stage's own
                if ready is not None:                              # report overwrites it
                    self.info[rank] = json.loads(ready)
                    pending.discard(rank)
                elif self._exit_code(rank) is not None:
                    raise self._diagnose(f"stage {rank} exited while loading")
            if time.monotonic() > deadline:
                remote = sorted(r for r in pending if r not in self.procs)
                hint = f"; is `pipellm stage` running on the hosts of stages {remote}?" if remote else ""
                raise PipelineError(f"stages {sorted(pending)} did not finish loading within {timeout_s:.0f} s{hint}")
            self._wait_any_exit(0.05)

    def _check_agent(self, store: comm.SignedStore, node: int, seen: dict[int, tuple[bytes, float]]) -> None:
        """A node agent that has been seen and then goes silent took its host's stages with it: fail now rather
        than at the start timeout. One not seen yet may still be starting: the user starts hosts in any order."""
        count, now = store.trusted(comm.agent_key(node)), time.monotonic()
        if count is None:
            return
        last, since = seen.get(node, (None, now))
        if count != last:
            seen[node] = (count, now)
        elif now - since > self.heartbeat_timeout_s:
            raise PipelineError(f"the node agent of host {node} (`pipellm stage`) stopped answering "
                                f"for {self.heartbeat_timeout_s:.0f} s while its stages were starting; is that host up?")

    def _exit_code(self, rank: int) -> int | None:
        if rank in self.procs:
            proc = self.procs[rank]
            code = proc.poll()
            if code is None and self.first_death is not None:
                # The watchdog is stopping the stages: while it waits on this process, poll() says None whatever
                # the process did; wait(timeout) waits for that wait to end.
                try:
                    code = proc.wait(1.0)
                except subprocess.TimeoutExpired:
                    pass
            return code
        code = self.store.trusted(comm.exit_key(rank))
        return None if code is None else int(code)

    def _stage_error(self, rank: int, report: bytes) -> Exception:
        err = json.loads(report)
        msg = f"stage {rank}: {err['type']}: {err['message']}"
        # Bad input reported by a stage (a missing tensor, a bad file) stays a ValueError for the user.
        return ValueError(msg) if err["type"] in ("ValueError", "FileNotFoundError") else PipelineError(
            f"{msg}\n{err['traceback']}")

    def _who(self, rank: int) -> str:
        info = self.info.get(rank, {})
        pid = self.procs[rank].pid if rank in self.procs else info.get("pid")
        where = "" if rank in self.procs or "host" not in info else f" on {info['host']}"
        return f"stage {rank} (pid {pid}{where})"

    def _diagnose(self, what: str) -> PipelineError:
        """Names the stages that died or reported an error. Waits briefly so a failure can propagate."""
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and self.first_death is None and (self.watching or all(
                self._exit_code(r) is None for r in range(len(self.stages)))):
            self._wait_any_exit(0.1)  # the watchdog, once running, names the stage that failed first
        # raised: a cause raised or crashed, and none was killed, exited or hung: a stage killed from outside makes
        # the others fail too (a closed connection), which is no fault of the batches out
        problems, raised, external = [], False, False
        first = self.first_death
        for rank in sorted(range(len(self.stages)), key=lambda r: r != first):  # the cause first
            error = self.store.trusted(comm.error_key(rank))
            has_error = error is not None
            if first is not None and rank != first and not has_error:
                continue  # stopped by the watchdog, not a cause
            if rank == first and self.hung:
                problems.append(f"{self._who(rank)} stopped answering: no heartbeat for "
                                f"{self.heartbeat_timeout_s:.0f} s")
                external = True
            elif has_error:
                err = json.loads(error)
                problems.append(f"{self._who(rank)} failed: {err['type']}: {err['message']}")
                raised = True
            elif (code := self._exit_code(rank)) is not None:
                problems.append(f"{self._who(rank)} {describe_exit(code)}")
                raised, external = raised or -code in FAULT_SIGNALS, external or -code not in FAULT_SIGNALS
        if first is not None and len(self.stages) > 1:
            problems.append("the other stages were stopped")
        return PipelineError(f"{what}: " + ("; ".join(problems) or "no stage reported a cause"),
                             raised and not external)

    def failure(self) -> PipelineError:
        """Why the pipeline is down (call when is_alive() is False)."""
        return self.failed or self._diagnose("the pipeline stopped")

    def _guard(self, what: str, fn, *args):
        if self.failed:
            raise self.failed
        try:
            return fn(*args)
        except wire.WireError as e:  # a stage sent what no stage of this run would: stop trusting the pipeline
            self.failed = PipelineError(f"{what}: {e}")
            self._kill()
            raise self.failed from None
        except RuntimeError as e:
            if "Timed out" in str(e):
                self.failed = self._diagnose(f"{what}: no answer within {self.step_timeout.total_seconds():.0f} s")
            else:
                self.failed = self._diagnose(what)
            self._kill()
            raise self.failed from None

    # ---- work -----------------------------------------------------------------------------------------------

    @property
    def last_rank(self) -> int:
        return comm.stage_world_rank(len(self.stages) - 1)

    def parts(self, batch: StageBatch) -> list[StageBatch]:
        """The batch as each stage gets it: only what that stage reads."""
        out = []
        for stage in self.stages:
            part = replace(batch, input_ids=batch.input_ids if stage.is_first else None)
            if not stage.is_last:
                part = replace(part, sample_req_ids=[], new_requests=[], finished_req_ids=[], prompt_rows=None,
                               prompt_targets=None, draft_token_ids=None)
            out.append(part)
        return out

    def submit(self, batch: StageBatch) -> None:
        """Sends a batch to every stage without waiting for it to run."""
        def send():
            for stage, part in zip(self.stages, self.parts(batch)):
                self.chan.send_obj(part, comm.stage_world_rank(stage.rank))
        self._guard("sending a batch", send)
        rows = None if batch.prompt_rows is None else len(batch.prompt_rows)
        # what its SampledBatch must hold
        self.expected.append((len(batch.logits_indices) * batch.num_steps, rows, batch.prompt_top_k,
                              num_drafts(batch.draft_token_ids)))

    def receive(self) -> SampledBatch:
        """The sampled tokens of the oldest batch in flight."""
        def recv():
            result = self.chan.recv_obj(self.last_rank, (SampledBatch,), self.step_timeout)
            try:
                result.check(self.vocab_size, *self.expected.popleft())
            except ValueError as e:
                raise wire.WireError(f"a message from {comm.peer_name(self.last_rank)} is malformed: {e}") from None
            return result
        return self._guard("waiting for the pipeline", recv)

    def receive_probes(self, batch: StageBatch) -> list[ProbeReport]:
        """Every stage's report on a probe batch, after its SampledBatch."""
        def recv():
            reports = []
            for stage in self.stages:
                rank = comm.stage_world_rank(stage.rank)
                report = self.chan.recv_obj(rank, (ProbeReport,), self.step_timeout)
                try:
                    assert report.batch_id == batch.batch_id and report.stage == stage.rank
                    report.check(stage.num_layers, self.num_layers, batch.num_tokens,
                                 len(batch.logits_indices), stage.is_last)
                except (AssertionError, ValueError) as e:
                    raise wire.WireError(f"a probe report from {comm.peer_name(rank)} is malformed: {e}") from None
                reports.append(report)
            return reports
        return self._guard("waiting for the probe reports", recv)

    def inspect(self) -> list[StageReport]:
        def ask():
            for stage in self.stages:
                self.chan.send_obj(Inspect(), comm.stage_world_rank(stage.rank))
            return [self.chan.recv_obj(comm.stage_world_rank(s.rank), (StageReport,), self.step_timeout)
                    for s in self.stages]
        return self._guard("inspecting the stages", ask)

    # ---- lifecycle ------------------------------------------------------------------------------------------

    def is_alive(self) -> bool:
        return not self.failed and self.first_death is None and all(p.poll() is None for p in self.procs.values())

    def stage_status(self) -> list[dict]:
        """Per stage: rank, pid, host, device, alive. Safe from any thread."""
        out = []
        for rank in range(len(self.stages)):
            info = self.info.get(rank, {})
            code = self.procs[rank].poll() if rank in self.procs else None
            alive = code is None and self.first_death is None and not self.failed
            out.append({"rank": rank, "pid": self.procs[rank].pid if rank in self.procs else info.get("pid"),
                        "host": info.get("host"), "device": info.get("device"), "alive": alive,
                        "returncode": code})
        return out

    def shutdown(self, timeout_s: float = 5.0) -> None:
        self._closing = True
        if hasattr(self, "_wake_w") and self._wake_w >= 0:
            try:
                os.write(self._wake_w, b"x")  # stops the watchdog
            except OSError:
                pass  # it stopped already
            os.close(self._wake_w)
            self._wake_w = -1
            if self._watchdog is not threading.current_thread():
                # Joined, not left running: a store call still under way while the interpreter exits aborts it
                # ("terminate called without an active exception").
                self._watchdog.join(timeout_s)
        if self.is_alive() and hasattr(self, "chan"):
            try:
                for stage in self.stages:
                    self.chan.send_obj(Shutdown(), comm.stage_world_rank(stage.rank))
                self.chan.flush(timedelta(seconds=timeout_s))
            except RuntimeError:
                pass
            deadline = time.monotonic() + timeout_s
            for proc in self.procs.values():
                try:
                    proc.wait(max(0.01, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        self._kill()

    def _wait_any_exit(self, timeout_s: float) -> None:
        fds = []
        try:
            for proc in self.procs.values():
                if proc.poll() is None:
                    fds.append(os.pidfd_open(proc.pid))
            select.select(fds, [], [], timeout_s)
        except ProcessLookupError:
            pass  # reaped after poll() by the watchdog, which is stopping every stage: that is an exit
        finally:
            for fd in fds:
                os.close(fd)

    def _kill(self) -> None:
        """Stops every stage of this generation: here directly, elsewhere through the node agents."""
        try:
            self.store.set(comm.ABORT_KEY, "1")
        except Exception:
            pass  # the store is gone: so are the node agents' stages
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs.values():
            proc.wait()
