"""The stage process: sets itself up (threads, cores, device), finds its work in the driver's store, beats its
heartbeat, and serves batches through its StageWorker (worker.py) until told to stop."""
import argparse
import ctypes
import itertools
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback

import torch

from pipellm import device
from pipellm.pipeline import comm, wire
from pipellm.pipeline.messages import StageArgs
from pipellm.pipeline.worker import StageWorker

START_TIMEOUT_S = 300.0  # how long a stage waits for the driver to publish its work


def _heartbeat(store_addr: tuple[str, int], token: bytes, generation: int, rank: int) -> None:
    """Raises a count in the store twice a second. It stops when the process stops (SIGSTOP, a hang in native code
    that holds the GIL, death), which is how the driver tells a hung stage from a slow one. A count, not a
    timestamp: the driver times its changes on its own clock, so clocks of other hosts do not matter."""
    store = comm.SignedStore(comm.make_store(*store_addr, is_master=False), token).generation(generation)
    for beat in itertools.count(1):
        store.set(comm.heartbeat_key(rank), str(beat))
        time.sleep(comm.HEARTBEAT_S)


def _release_free_heap() -> None:
    # glibc keeps the heap pages that loading freed (repacking, file reads): ~9 MB a stage of the default model.
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _die_with_parent() -> None:
    # Linux: SIGKILL this process when the driver dies, however it dies.
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    parent = os.environ.get(comm.PARENT_PID_ENV)
    if parent is not None and os.getppid() != int(parent):  # it died while we started: no signal will come (an
        os._exit(1)                                        # orphan waited START_TIMEOUT_S for its store)


def stage_cores(local_rank: int, local_world_size: int, threads: int) -> list[int]:
    """The cores of this host that the local_rank-th stage on it pins itself to."""
    cores = sorted(os.sched_getaffinity(0))
    return [cores[(local_rank * threads + i) % len(cores)] for i in range(threads)]


def set_up_process(ecfg, local_rank: int = 0, local_world_size: int = 1, pin: bool = True) -> torch.device:
    """What a stage sets for its whole process before loading: oneDNN's caches bounded, its torch threads (pinned to
    its own cores when pin), its device. Returns the device."""
    device.bound_onednn_caches()
    threads = ecfg.threads_per_stage or max(1, len(os.sched_getaffinity(0)) // local_world_size)
    if pin:
        os.sched_setaffinity(0, stage_cores(local_rank, local_world_size, threads))
    torch.set_num_threads(threads)
    dev = device.stage_device(device.resolve(ecfg.device), local_rank, local_world_size)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    return dev


def _generation(store: comm.SignedStore) -> int:
    """The pipeline this stage belongs to: from its parent, or (under torchrun) the newest the driver signed."""
    if os.environ.get(comm.GENERATION_ENV, "").isdigit():
        return int(os.environ[comm.GENERATION_ENV])
    deadline = time.monotonic() + START_TIMEOUT_S
    while (newest := store.trusted(comm.GENERATION_KEY)) is None:  # not published yet, or forged: wait
        if time.monotonic() > deadline:
            raise TimeoutError(f"no pipeline signed with this run's token was published within {START_TIMEOUT_S} s")
        time.sleep(0.05)
    return int(newest)


def stage_main(world_rank: int, master_addr: str, master_port: int, token: bytes, local_rank: int = 0,
               local_world_size: int = 1, model_dir: str | None = None) -> None:
    """Entry point of a stage process: world rank r >= 1 runs stage r - 1 of the newest generation's plan."""
    _die_with_parent()
    # Ctrl-C, and a SIGTERM sent to the whole process group (timeout, systemd), are the driver's to handle: it shuts
    # us down (and if it dies, so do we: _die_with_parent). Taken here, it would restart us while it stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    rank = world_rank - 1
    store = None
    try:
        base = comm.SignedStore(comm.make_store(master_addr, master_port, is_master=False,
                                                timeout_s=START_TIMEOUT_S), token)
        generation = _generation(base)
        store = base.generation(generation)
        args = wire.decode(store.get(comm.args_key(rank)), (StageArgs,))
        if model_dir is not None:
            args.model_dir = model_dir  # this host's own copy of the checkpoint
        dev = set_up_process(args.engine_config, local_rank, local_world_size)
        worker = StageWorker(args, dev)
        _release_free_heap()
        store.set(comm.device_key(rank), device.identity(dev))
        store.set(comm.heartbeat_key(rank), "0")
        threading.Thread(target=_heartbeat, args=((master_addr, master_port), token, generation, rank),
                         name="pipellm-heartbeat", daemon=True).start()
        store.set(comm.ready_key(rank), json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                                    "device": str(dev)}))
        chan = comm.make_channel(store, world_rank, args.num_stages, master_addr, args.engine_config.batches_in_flight)
        chan.links = comm.nccl_links(store, rank, args.num_stages, device.identity(dev))
        worker.serve(chan)
    except BaseException as e:  # report any failure where the driver looks for it, then exit non-zero
        if store is not None:
            try:
                store.set(comm.error_key(rank), json.dumps({"type": type(e).__name__, "message": str(e),
                                                            "traceback": traceback.format_exc()}))
            except Exception:
                pass
        if store is None or comm.GENERATION_ENV not in os.environ:
            traceback.print_exc()  # no parent to report it: under torchrun, this log is where users look
        os._exit(1)
    os._exit(0)  # skip interpreter teardown: gloo's destructors can block on peers that already left


def _env_int(name: str) -> int:
    value = os.environ.get(name)
    if value is None or not value.isdigit():
        sys.exit(f"pipellm stage: environment variable {name} must be set to an integer (got {value!r}); "
                 "start stages with torchrun, `pipellm stage`, or let the driver start them")
    return int(value)


def main(argv: list[str] | None = None) -> None:
    """`python -m pipellm.pipeline.stage [--model PATH]`, as torchrun or a node agent starts it. Reads RANK (1..P;
    rank 0 is the driver), MASTER_ADDR and MASTER_PORT (the driver's rendezvous store), LOCAL_RANK and
    LOCAL_WORLD_SIZE (which cores of this host to take), and its layers from the store."""
    parser = argparse.ArgumentParser(prog="python -m pipellm.pipeline.stage")
    parser.add_argument("--model", default=None, help="this host's copy of the model (default: the driver's path)")
    parser.add_argument("--token-file", default=None, help=f"the driver's token (or set {wire.TOKEN_ENV})")
    args = parser.parse_args(argv)
    try:
        token = wire.token_from_env_or_file(args.token_file)
    except ValueError as e:
        sys.exit(f"pipellm stage: {e}")
    if token is None:
        sys.exit(f"pipellm stage: no token; give the driver's with --token-file or {wire.TOKEN_ENV}")
    rank = _env_int("RANK")
    if rank < 1:
        sys.exit("pipellm stage: RANK 0 is the driver (pipellm serve / generate); stages have RANK 1 and up")
    model_dir = None
    if args.model is not None:
        from pipellm.loader.model_folder import resolve_model
        model_dir = resolve_model(args.model)
    stage_main(rank, os.environ.get("MASTER_ADDR", "127.0.0.1"), _env_int("MASTER_PORT"), token,
               int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1)), model_dir)


if __name__ == "__main__":
    main()
