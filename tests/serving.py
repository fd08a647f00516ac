"""Runs `pipellm serve` as a user does, in a subprocess on a free loopback port, for the tests that need a server."""
import os
import subprocess
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import openai

from benchmarks.soak import start_server, stop_server
from tests.conftest import FP32

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


def listening(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket the process listens on, read from /proc."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                    addr, port = cols[1].split(":")
                    raw = bytes.fromhex(addr)
                    # /proc prints each 32-bit word in host (little-endian) order
                    words = [raw[i:i + 4][::-1] for i in range(0, len(raw), 4)]
                    ip = b"".join(words)
                    text = ".".join(map(str, ip)) if len(ip) == 4 else (
                        ".".join(map(str, ip[12:])) if ip[:12] == b"\0" * 10 + b"\xff\xff" else ip.hex())
                    out.append((text, int(port, 16)))
    return out


@contextmanager
def serve(model_dir: str, tmp_dir, *extra: str):
    """A healthy `pipellm serve -pp 2 --model model_dir *extra`, its output in a log file under tmp_dir; FP32
    unless extra says --dtype, as the engines it is compared with (tests/conftest.py, llm_pp2)."""
    fd, log = tempfile.mkstemp(prefix="server-", suffix=".log", dir=tmp_dir)
    os.close(fd)
    proc, url = start_server(model_dir, list(extra) + ([] if "--dtype" in extra else ["--dtype", FP32]), log)
    try:
        yield Server(url, proc, log)
    finally:
        stop_server(proc)
