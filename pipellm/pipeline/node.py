"""`pipellm stage`: the node agent of a host other than the driver's.

It connects to the driver's rendezvous store, starts this host's stages for every pipeline the driver publishes (the
first one and each restart), writes their exit codes where the driver's watchdog looks, and ends with the driver.
"""
import itertools
import subprocess
import time
from datetime import timedelta

from pipellm.pipeline import comm, wire
from pipellm.pipeline.launch import stage_env, start_stage
from pipellm.pipeline.messages import StageArgs
from pipellm.pipeline.partition import node_of_stage

POLL_S = 0.2


class NodeAgent:
    def __init__(self, nnodes: int, node_rank: int, master_addr: str, master_port: int, model_dir: str | None,
                 token: bytes | None, connect_timeout_s: float = 300.0):
        if nnodes < 2:
            raise ValueError(f"--nnodes {nnodes}: `pipellm stage` runs stages for a driver on another host; give "
                             "--nnodes (hosts in all, >= 2) and --node-rank (this host, 1 to nnodes - 1)")
        if not 1 <= node_rank < nnodes:
            raise ValueError(f"--node-rank {node_rank}: give 1 to {nnodes - 1}; node 0 is the driver's host, "
                             "where `pipellm serve` (or generate, bench) runs with --node-rank 0")
        if token is None:
            raise ValueError(f"no token: give the driver's token file with --token-file FILE, or set "
                             f"{wire.TOKEN_ENV} to the driver's token")
        self.nnodes, self.node_rank, self.model_dir, self.token = nnodes, node_rank, model_dir, token
        self.addr = (master_addr, master_port)
        print(f"node {node_rank}: connecting to the driver at {master_addr}:{master_port}", flush=True)
        try:
            self.store = comm.SignedStore(comm.make_store(master_addr, master_port, is_master=False,
                                                          timeout_s=connect_timeout_s), token)
            self.store.wait([comm.NNODES_KEY], timedelta(seconds=connect_timeout_s))
        except RuntimeError as e:  # DistNetworkError, DistStoreError
            raise ValueError(f"no driver answered at {master_addr}:{master_port} within {connect_timeout_s:.0f} s "
                             f"({e}); start `pipellm serve --nnodes {nnodes} --node-rank 0 ...` there, or check "
                             "--master-addr, --master-port and the firewall") from None
        try:
            driver_nnodes = int(self.store.get(comm.NNODES_KEY))
        except wire.WireError:
            raise ValueError(f"refused by the driver at {master_addr}:{master_port}: this host's token is not the "
                             f"driver's; give `pipellm stage` the driver's token file (--token-file) or "
                             f"{wire.TOKEN_ENV}") from None
        if driver_nnodes != nnodes:
            raise ValueError(f"--nnodes {nnodes}, but the driver at {master_addr}:{master_port} runs with "
                             f"--nnodes {driver_nnodes}; give both the same")
        self.procs: dict[int, subprocess.Popen] = {}  # stage rank -> process, of the current generation
        self.reported: set[int] = set()

    def run(self) -> int:
        """Serves pipeline after pipeline until the driver shuts down (0) or goes away (1)."""
        generation, gstore = None, None
        try:
            for beat in itertools.count(1):
                if self.store.trusted(comm.SHUTDOWN_KEY) is not None:
                    break
                self.store.set(comm.agent_key(self.node_rank), str(beat))
                newest = self.store.trusted(comm.GENERATION_KEY)
                if newest is not None and int(newest) != generation:
                    self._stop()  # a new pipeline replaces the failed one
                    generation = int(newest)
                    gstore = self.store.generation(generation)
                    self._start(gstore, generation)
                if gstore is not None:
                    self._report_exits(gstore)
                    if gstore.trusted(comm.ABORT_KEY) is not None:
                        self._stop()
                time.sleep(POLL_S)
        except wire.WireError as e:  # a signed generation whose plan is not: nothing of it can be trusted to run
            print(f"node {self.node_rank}: refused the driver's plan: {e}; stopping", flush=True)
            return 1
        except RuntimeError as e:  # the store's errors (DistNetworkError, DistStoreError) are RuntimeErrors
            print(f"node {self.node_rank}: lost the driver at {self.addr[0]}:{self.addr[1]} ({e}); stopping",
                  flush=True)
            return 1
        finally:
            self._stop(grace_s=5.0)
        self.store.set(comm.bye_key(self.node_rank), "1")  # the driver waits for it
        print(f"node {self.node_rank}: the driver shut down; done", flush=True)
        return 0

    def _start(self, gstore, generation: int) -> None:
        num_stages = wire.decode(gstore.get(comm.args_key(0)), (StageArgs,)).num_stages
        ranks = [r for r in range(num_stages) if node_of_stage(r, num_stages, self.nnodes) == self.node_rank]
        for i, rank in enumerate(ranks):
            env = stage_env(comm.stage_world_rank(rank), num_stages + 1, *self.addr, i, len(ranks), self.token,
                            generation)
            self.procs[rank] = start_stage(env, self.model_dir)
        self.reported = set()
        print(f"node {self.node_rank}: pipeline {generation}: started stages {ranks} "
              f"(pids {[p.pid for p in self.procs.values()]})", flush=True)

    def _report_exits(self, gstore) -> None:
        for rank, proc in self.procs.items():
            if rank not in self.reported and proc.poll() is not None:
                gstore.set(comm.exit_key(rank), str(proc.returncode))
                self.reported.add(rank)

    def _stop(self, grace_s: float = 0.0) -> None:
        deadline = time.monotonic() + grace_s
        for proc in self.procs.values():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs = {}
