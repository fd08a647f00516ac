"""A bounded soak of `pipellm serve`: C concurrent streaming clients send N requests in all, some hanging up early.

Half the requests go to /v1/completions and half to /v1/chat/completions (stream=True), with prompts of random
lengths from a seeded RNG. A random --abort-fraction of them close the stream after a random number of chunks, which
makes the server abort the request. Meanwhile the RSS of the server and of every stage process is sampled every
0.25 s. At the end it reports what a leak or a lost request would show: requests sent, completed (a finish_reason
came), aborted on purpose, lost (anything else: an HTTP error, an error event, a stream cut short, a timeout), the KV
cache usage and the running/waiting gauges once the server is idle, the RSS in the first quarter of the run against
the last quarter, and whether /health still answers 200.

    python benchmarks/soak.py [--model DIR] [--concurrency 64] [--requests 512] [--max-tokens 32] [--json OUT]
Without --model the server runs the default model.
"""
import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

# Prompts are drawn from these words; --max-prompt-words bounds their length (a word is 1-3 tokens).
WORDS = ("the quick brown fox jumps over a lazy dog while every stage of the pipeline keeps busy and tokens flow "
         "from one stage to the next once upon a time there was little girl hello world how are you today capital "
         "France is Paris").split()
RSS_PERIOD_S = 0.25


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir: str | None, server_args: list[str],
                 log_path: str | None = None) -> tuple[subprocess.Popen, str]:
    """`pipellm serve -pp 2` on a free loopback port, once healthy; its output goes to log_path (else ours)."""
    port = free_port()
    cmd = [sys.executable, "-m", "pipellm.entrypoints.cli", "serve", "-pp", "2", "--port", str(port),
           "--log-level", "warning", *(["--model", model_dir] if model_dir else []), *server_args]
    log = open(log_path, "w") if log_path else None
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT if log else None)
    if log:
        log.close()

    def output() -> str:
        return open(log_path).read() if log_path else "(its output is above)"

    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300  # the default model may be converted from its GGUF first
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{output()}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"server not healthy within 300 s:\n{output()}")
        time.sleep(0.2)


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def metrics(url: str) -> dict[str, float]:
    """name[label values] -> value, without the model_name label."""
    out = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for s in family.samples:
            out[s.name + "".join(f"[{v}]" for k, v in sorted(s.labels.items()) if k != "model_name")] = s.value
    return out


def _gauge(m: dict[str, float], part: str) -> float:
    return next(v for k, v in m.items() if part in k)


def _rss_kib(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        pass
    return None


class RssSampler(threading.Thread):
    """Reads VmRSS of the given pids every RSS_PERIOD_S, on its own thread so a busy event loop delays no sample."""

    def __init__(self, pids: list[int]):
        super().__init__(daemon=True)
        self.pids, self.samples, self.stopped = pids, [], threading.Event()
        self.start_time = time.monotonic()

    def run(self) -> None:
        while not self.stopped.is_set():
            rss = [_rss_kib(pid) for pid in self.pids]
            if None not in rss:  # a process that is gone shows up in the health check instead
                self.samples.append((time.monotonic() - self.start_time, rss))
            self.stopped.wait(RSS_PERIOD_S)

    def quarters(self, elapsed_s: float) -> tuple[list[float], list[float]]:
        """Mean RSS (MiB) of each process over the first and the last quarter of the run."""
        def mean(rows):
            return [sum(col) / len(rows) / 1024 for col in zip(*rows)]
        return (mean([rss for t, rss in self.samples if t <= elapsed_s / 4]),
                mean([rss for t, rss in self.samples if t >= elapsed_s * 3 / 4]))


def make_requests(n: int, max_tokens: int, abort_fraction: float, max_prompt_words: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, max_prompt_words)))
        chat = rng.random() < 0.5
        body = {"max_tokens": max_tokens, "temperature": 1.0, "seed": seed * 1_000_003 + i, "stream": True}
        body |= {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
        abort_after = rng.randint(1, max_tokens) if rng.random() < abort_fraction else None
        out.append({"path": "/v1/chat/completions" if chat else "/v1/completions", "body": body,
                    "abort_after": abort_after})
    return out


async def _one(client: httpx.AsyncClient, url: str, req: dict) -> tuple[str, str | None]:
    """('completed' | 'aborted' | 'lost', why it was lost)."""
    chunks, finished = 0, False
    try:
        async with client.stream("POST", url + req["path"], json=req["body"]) as resp:
            if resp.status_code != 200:
                return "lost", f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    return ("completed", None) if finished else ("lost", "[DONE] without a finish_reason")
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return "lost", f"error event: {chunk['error']['message']}"
                chunks += 1
                finished = finished or any(c.get("finish_reason") for c in chunk["choices"])
                if not finished and chunks == req["abort_after"]:
                    return "aborted", None  # leaving the block closes the connection mid-stream
        return "lost", f"stream ended after {chunks} chunks without [DONE]"
    except Exception as e:  # every failure is a lost request, reported by name
        return "lost", f"{type(e).__name__}: {e}"


async def _drive(url: str, reqs: list[dict], concurrency: int, timeout_s: float) -> list[tuple[str, str | None]]:
    results: list = [("lost", "not finished within the soak's timeout")] * len(reqs)
    queue = iter(range(len(reqs)))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(120, connect=30), limits=limits) as client:
        async def worker():
            for i in queue:  # shared: each request is taken by one worker
                results[i] = await _one(client, url, reqs[i])

        tasks = [asyncio.create_task(worker()) for _ in range(concurrency)]
        _, pending = await asyncio.wait(tasks, timeout=timeout_s)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    return results


def run_soak(model_dir: str | None, concurrency: int = 64, requests: int = 512, max_tokens: int = 32,
             abort_fraction: float = 0.25, seed: int = 0, max_prompt_words: int = 32, server_args: list[str] = (),
             timeout_s: float = 1800, settle_s: float = 10, log_path: str | None = None) -> dict:
    """Starts `pipellm serve -pp 2`, soaks it, stops it; returns the figures (see the module doc)."""
    reqs = make_requests(requests, max_tokens, abort_fraction, max_prompt_words, seed)
    log_path = log_path or os.path.join(os.environ.get("TMPDIR", "/tmp"), f"pipellm-soak-{os.getpid()}.log")
    proc, url = start_server(model_dir, list(server_args), log_path)
    try:
        stage_pids = [s["pid"] for s in httpx.get(f"{url}/health", timeout=10).json()["stages"]]
        before = metrics(url)
        sampler = RssSampler([proc.pid, *stage_pids])
        sampler.start()
        start = time.monotonic()
        results = asyncio.run(_drive(url, reqs, concurrency, timeout_s))
        elapsed = time.monotonic() - start
        sampler.stopped.set()
        sampler.join()

        # Aborts reach the engine a moment after the client hangs up: give the gauges time to settle.
        deadline = time.monotonic() + settle_s
        while True:
            after = metrics(url)
            idle = [_gauge(after, p) for p in ("kv_cache_usage", "num_requests_running", "num_requests_waiting")]
            if not any(idle) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        health = httpx.get(f"{url}/health", timeout=10).status_code
    finally:
        stop_server(proc)

    outcomes = [r[0] for r in results]
    errors = sorted({why for what, why in results if what == "lost"})
    rss_first, rss_last = sampler.quarters(elapsed)
    finished = {k.split("[")[1].rstrip("]"): after[k] - before.get(k, 0) for k in after
                if k.startswith("pipellm:request_finished_total[")}
    return {
        "config": dict(model=model_dir, concurrency=concurrency, requests=requests, max_tokens=max_tokens,
                       abort_fraction=abort_fraction, seed=seed, max_prompt_words=max_prompt_words,
                       server_args=list(server_args)),
        "sent": len(reqs),
        "completed": outcomes.count("completed"),
        "aborted": outcomes.count("aborted"),
        "lost": outcomes.count("lost"),
        "lost_reasons": errors[:10],
        "server_finished": finished,  # the server's own count per finish reason, for comparison
        "elapsed_s": elapsed,
        "requests_per_s": len(reqs) / elapsed,
        "kv_cache_usage": idle[0],
        "num_requests_running": idle[1],
        "num_requests_waiting": idle[2],
        "rss_samples": len(sampler.samples),
        "rss_first_quarter_mib": sum(rss_first),  # server + stages
        "rss_last_quarter_mib": sum(rss_last),
        "rss_ratio": sum(rss_last) / sum(rss_first),
        "rss_by_process_mib": {name: [first, last] for name, first, last in
                               zip(["server", *(f"stage {i}" for i in range(len(stage_pids)))], rss_first, rss_last)},
        "health_status": health,
        "server_log": log_path,
    }


def summary(r: dict) -> str:
    return "\n".join([
        f"{r['sent']} requests from {r['config']['concurrency']} streaming clients in {r['elapsed_s']:.1f} s "
        f"({r['requests_per_s']:.2f} req/s)",
        f"  completed {r['completed']}, aborted on purpose {r['aborted']}, lost {r['lost']}",
        *(f"  lost: {why}" for why in r["lost_reasons"]),
        f"  server finish reasons: {json.dumps(r['server_finished'])}",
        f"  after the run: KV cache usage {r['kv_cache_usage']:.4f}, running {r['num_requests_running']:.0f}, "
        f"waiting {r['num_requests_waiting']:.0f}, /health {r['health_status']}",
        f"  RSS (server + stages, {r['rss_samples']} samples): first quarter {r['rss_first_quarter_mib']:.1f} MiB, "
        f"last quarter {r['rss_last_quarter_mib']:.1f} MiB, ratio {r['rss_ratio']:.3f}",
        *(f"    {name}: {first:.1f} -> {last:.1f} MiB" for name, (first, last) in r["rss_by_process_mib"].items()),
    ])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model folder or .gguf; default: the default model")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--requests", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--abort-fraction", type=float, default=0.25)
    p.add_argument("--max-prompt-words", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-args", default="", help="extra `pipellm serve` arguments")
    p.add_argument("--timeout", type=float, default=1800, help="requests not done by then count as lost")
    p.add_argument("--json", default=None, help="save the figures to this file")
    args = p.parse_args()
    result = run_soak(args.model, args.concurrency, args.requests, args.max_tokens, args.abort_fraction, args.seed,
                      args.max_prompt_words, args.server_args.split(), args.timeout)
    print(summary(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    sys.exit(0 if result["lost"] == 0 and result["health_status"] == 200 else 1)


if __name__ == "__main__":
    main()
