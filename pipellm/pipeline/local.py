"""A one-stage pipeline in the driver's own process (vLLM's "uni" executor): no transport and no second process.

On a CPU the driver and a stage process share the same cores, and every token crosses gloo twice (the batch out,
the sampled token back): ~2-3 ms of a ~10 ms token (BENCHMARKS.md, "The stage in the driver's process"). Here the
driver calls the stage's step directly. What it gives up: a stage that dies takes the driver with it, so
restart_on_failure keeps the stage in a process of its own ("mp")."""
import collections
import dataclasses
import os
import socket
import traceback

from pipellm.config import EngineConfig
from pipellm.model_config import ModelConfig
from pipellm.pipeline.executor import PipelineError
from pipellm.pipeline.messages import ProbeReport, SampledBatch, StageArgs, StageBatch, StageReport
from pipellm.pipeline.partition import StageLayers
from pipellm.pipeline.stage import set_up_process
from pipellm.pipeline.worker import StageWorker


class _Outbox:
    """What the stage would send the driver, kept in order until the driver takes it."""

    def __init__(self):
        self.messages: collections.deque = collections.deque()

    def send_obj(self, obj, dst: int) -> None:
        self.messages.append(obj)


class LocalExecutor:
    def __init__(self, model_dir: str, model_config: ModelConfig, engine_config: EngineConfig,
                 stages: list[StageLayers], num_blocks: int, num_window_blocks: int = 0, generation: int = 0):
        assert len(stages) == 1, "one stage in the driver's process"
        self.stages, self.generation, self.procs = stages, generation, {}
        self.failed: PipelineError | None = None
        # this process's torch threads are the stage's; it is not pinned to cores: it may be the user's own program
        self.device = set_up_process(engine_config, pin=False)
        args = StageArgs(stages[0], 1, model_dir, model_config, engine_config, num_blocks, num_window_blocks)
        self.worker = StageWorker(args, self.device)
        self.outbox = self.worker.chan = _Outbox()

    def _run(self, what: str, fn, *args):
        if self.failed:
            raise self.failed
        try:
            return fn(*args)
        except Exception as e:  # the stage's state may be half updated: this pipeline is done
            self.failed = PipelineError(f"stage 0 (in the driver's process) failed while {what}: "
                                        f"{type(e).__name__}: {e}\n{traceback.format_exc()}", raised=True)
            raise self.failed from e

    def parts(self, batch: StageBatch) -> list[StageBatch]:
        return [batch]

    def submit(self, batch: StageBatch) -> None:
        """Runs the batch now; its result waits for receive(). A copy: the stage fills in fields of its own."""
        self._run("running a batch", self.worker.step, dataclasses.replace(batch))

    def _take(self, kind: type):
        msg = self.outbox.messages.popleft()
        assert isinstance(msg, kind), f"expected a {kind.__name__}, the stage left a {type(msg).__name__}"
        return msg

    def receive(self) -> SampledBatch:
        return self._take(SampledBatch)

    def receive_probes(self, batch: StageBatch) -> list[ProbeReport]:
        return [self._take(ProbeReport)]

    def inspect(self) -> list[StageReport]:
        return [self._run("reporting", self.worker.report)]

    def is_alive(self) -> bool:
        return self.failed is None

    def failure(self) -> PipelineError:
        return self.failed or PipelineError("stage 0 (in the driver's process) failed")

    def stage_status(self) -> list[dict]:
        return [{"rank": 0, "pid": os.getpid(), "host": socket.gethostname(), "device": str(self.device),
                 "alive": self.is_alive(), "returncode": None}]

    def shutdown(self, timeout_s: float = 5.0) -> None:
        self.failed = self.failed or PipelineError("the pipeline was shut down")
        self.worker = None  # its weights and KV caches go with it
