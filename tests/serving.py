"""Runs `pipellm serve` as a user does, in a subprocess on a free loopback port, for the tests that need a server."""
import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import openai

KEY = "test-key"


@dataclass
class Server:
    url: str
    proc: subprocess.Popen
    log: str

    def stage_pids(self) -> list[int]:
        return [s["pid"] for s in httpx.get(f"{self.url}/health").json()["stages"]]

    def client(self, key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=60)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def is_running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_until(cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@contextmanager
def serve(model_dir: str, tmp_dir, *extra: str):
    port = free_port()
    log = os.path.join(tmp_dir, f"server-{port}.log")
    cmd = [sys.executable, "-m", "pipellm.entrypoints.cli", "serve", "--model", model_dir, "-pp", "2",
           "--port", str(port), "--log-level", "warning", *extra]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    server = Server(f"http://127.0.0.1:{port}", proc, log)
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, f"server exited with {proc.returncode}:\n{open(log).read()}"
            assert time.monotonic() < deadline, f"server not healthy in time:\n{open(log).read()}"
            try:
                if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        yield server
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
