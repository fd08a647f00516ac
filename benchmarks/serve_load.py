"""Load on `pipellm serve`: N concurrent streaming clients, each sending its requests one after another.

Prompts are random token ids (as `pipellm bench`), sent to /v1/completions with stream=True, greedy, ignore_eos, so
every request generates exactly --output-len tokens. Reports requests/s, generated tokens/s, TTFT p50/p99 and the
inter-token latency as the clients saw them.

    python benchmarks/serve_load.py [--clients 32] [--requests-per-client 2] [--url http://127.0.0.1:8000]
Without --url it starts `pipellm serve -pp 2` (the default model) on a free loopback port and stops it afterwards.
"""
import argparse
import asyncio
import json
import random
import statistics
import time

import httpx

from soak import start_server, stop_server  # benchmarks/ itself: they run as scripts


def percentile(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], output_len: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first = None
    usage = None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and first is None:
                first = time.perf_counter()
            usage = chunk.get("usage") or usage
    end = time.perf_counter()
    n = usage["completion_tokens"]
    return {"ttft": first - start, "e2e": end - start, "tokens": n,
            "itl": (end - first) / (n - 1) if n > 1 else 0.0}


async def run_load(url: str, clients: int, per_client: int, input_len: tuple[int, int], output_len: int,
                   seed: int) -> dict:
    rng = random.Random(seed)
    async with httpx.AsyncClient(timeout=600) as client:
        model = (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]
        await one_request(client, url, model, [rng.randrange(1000, 40000) for _ in range(16)], 4)  # warm-up
        prompts = [[[rng.randrange(1000, 40000) for _ in range(rng.randint(*input_len))] for _ in range(per_client)]
                   for _ in range(clients)]

        async def run_client(mine: list[list[int]]) -> list[dict]:
            return [await one_request(client, url, model, p, output_len) for p in mine]

        start = time.perf_counter()
        results = [r for rs in await asyncio.gather(*(run_client(p) for p in prompts)) for r in rs]
        elapsed = time.perf_counter() - start
    ttft = [r["ttft"] for r in results]
    return {
        "config": dict(url=url, clients=clients, requests_per_client=per_client, input_len=list(input_len),
                       output_len=output_len, seed=seed),
        "elapsed_s": elapsed,
        "requests": len(results),
        "requests_per_s": len(results) / elapsed,
        "generated_tokens_per_s": sum(r["tokens"] for r in results) / elapsed,
        "ttft_s": {"p50": percentile(ttft, 50), "p99": percentile(ttft, 99)},
        "itl_s": {"p50": percentile([r["itl"] for r in results], 50)},
        "e2e_s": {"p50": percentile([r["e2e"] for r in results], 50)},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default=None, help="a running server; default: start `pipellm serve -pp 2`")
    p.add_argument("--server-args", default="", help="extra `pipellm serve` arguments when starting one")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--input-len", default="64-192", help="prompt length range in tokens")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="save the figures to this file")
    args = p.parse_args()
    lo, _, hi = args.input_len.partition("-")
    proc, url = (None, args.url) if args.url else start_server(None, args.server_args.split())
    try:
        result = asyncio.run(run_load(url, args.clients, args.requests_per_client, (int(lo), int(hi or lo)),
                                      args.output_len, args.seed))
    finally:
        if proc is not None:
            stop_server(proc)
    print(f"{result['requests']} requests from {args.clients} streaming clients in {result['elapsed_s']:.1f} s: "
          f"{result['requests_per_s']:.2f} req/s, {result['generated_tokens_per_s']:.1f} generated tok/s, "
          f"TTFT p50 {result['ttft_s']['p50']:.2f} s p99 {result['ttft_s']['p99']:.2f} s, "
          f"ITL p50 {result['itl_s']['p50'] * 1000:.0f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
