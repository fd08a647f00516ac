"""Starting a stage process on this host, for the driver (executor.py) and for a node agent (node.py): its
environment, and the one thread that spawns every stage."""
import os
import queue
import subprocess
import sys
import threading
from concurrent.futures import Future

from pipellm.pipeline import comm, wire

STAGE_ENTRY = "from pipellm.pipeline.stage import main; main()"


def describe_exit(code: int) -> str:
    return f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"


def stage_env(world_rank: int, world_size: int, master_addr: str, master_port: int, local_rank: int,
              local_world_size: int, token: bytes, generation: int) -> dict[str, str]:
    """The environment a stage process reads: the names torchrun uses, the run's token (the environment of a
    process is readable by its owner only) and the pipeline it belongs to."""
    return {**os.environ, "RANK": str(world_rank), "WORLD_SIZE": str(world_size), "MASTER_ADDR": master_addr,
            "MASTER_PORT": str(master_port), "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(local_world_size),
            wire.TOKEN_ENV: token.decode(), comm.GENERATION_ENV: str(generation)}


_spawn_requests: queue.Queue = queue.Queue()


def _spawner() -> None:
    while True:
        cmd, env, future = _spawn_requests.get()
        try:
            future.set_result(subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL))
        except BaseException as e:
            future.set_exception(e)


_spawner_lock = threading.Lock()
_spawner_thread: threading.Thread | None = None


def start_stage(env: dict[str, str], model_dir: str | None = None) -> subprocess.Popen:
    """Starts a stage process from one daemon thread that lives as long as this process: a stage kills itself when
    the thread that started it ends (PR_SET_PDEATHSIG is per thread), and restarts happen on whichever thread
    steps the engine. A fresh interpreter running the stage module: unlike multiprocessing's spawn, it does not
    re-import the user's script, so scripts need no `if __name__ == "__main__"` guard."""
    global _spawner_thread
    with _spawner_lock:
        if _spawner_thread is None:
            _spawner_thread = threading.Thread(target=_spawner, name="pipellm-spawner", daemon=True)
            _spawner_thread.start()
    future: Future = Future()
    cmd = [sys.executable, "-c", STAGE_ENTRY, *(["--model", model_dir] if model_dir else [])]
    _spawn_requests.put((cmd, {**env, comm.PARENT_PID_ENV: str(os.getpid())}, future))
    return future.result(timeout=60)
