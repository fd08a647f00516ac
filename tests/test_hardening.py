"""Hardening of `pipellm serve`: a bounded soak (no lost request, every KV block freed, flat RSS) and a fuzz of the
HTTP API with schemathesis (never a 5xx). Both run a real server subprocess on the tiny Llama, on loopback."""
import json
import os
import subprocess
import sys
import time
from datetime import timedelta

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from pydantic.json_schema import models_json_schema

from benchmarks.soak import run_soak
from pipellm import kernels
from pipellm.entrypoints.protocol import ChatRequest, CompletionRequest
from pipellm.entrypoints.responses import ResponsesRequest
from tests.conftest import VOCAB
from tests.serving import serve

MAX_MODEL_LEN = 128
FUZZ_BUDGET_S = 300  # per endpoint; about 10-30 s when the server is healthy


def test_soak_loses_nothing_frees_every_block_and_rss_is_flat(llama_dir, tmp_path):
    # About 20 s of load on 2 cores: long enough that a leak of a few KiB per request shows in the RSS.
    r = run_soak(llama_dir, concurrency=64, requests=2048, max_tokens=16, abort_fraction=0.25, seed=0,
                 max_prompt_words=24, server_args=["--max-model-len", str(MAX_MODEL_LEN)], timeout_s=150,
                 log_path=str(tmp_path / "server.log"))
    assert r["lost"] == 0, r["lost_reasons"]
    assert r["completed"] + r["aborted"] == r["sent"] == 2048
    assert r["aborted"] > 0.15 * r["sent"]  # the aborts did happen
    assert r["kv_cache_usage"] == 0.0
    assert r["num_requests_running"] == r["num_requests_waiting"] == 0
    assert r["rss_ratio"] <= 1.10, r["rss_by_process_mib"]
    assert r["health_status"] == 200


@pytest.mark.skipif(not kernels.has_bf16_matmul(), reason="no bf16 instructions: torch's bf16 matmul does not use "
                    "oneDNN's compiled kernels on this CPU")
def test_bf16_stage_memory_stays_bounded_over_many_batch_shapes(llama_dir, tmp_path):
    """oneDNN compiles a kernel per matmul shape: 250 prompts of distinct lengths make 250 token counts. In a fresh
    process, as a user's program: the stage runs in it, after dtype="auto" has timed bf16 matmuls there (oneDNN
    reads its cache bounds at the first one)."""
    script = f"""
from pipellm import LLM, SamplingParams
with LLM({llama_dir!r}, max_num_seqs=1):  # dtype "auto", timed in this process: its cache is empty
    pass
prompts = [{{"prompt_token_ids": [(7 * n + j) % ({VOCAB} - 1) + 1 for j in range(n)]}} for n in range(1, 251)]
with LLM({llama_dir!r}, dtype="bfloat16", max_num_seqs=1) as llm:
    llm.generate(prompts[:20], SamplingParams(max_tokens=1), use_tqdm=False)
    before = llm.engine.inspect()[0].rss_bytes
    llm.generate(prompts[20:], SamplingParams(max_tokens=1), use_tqdm=False)
    print(llm.engine.inspect()[0].rss_bytes - before)
"""
    env = {**os.environ, "PIPELLM_CACHE_DIR": str(tmp_path)}
    env = {k: v for k, v in env.items() if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    grown = int(out.stdout.split()[-1])
    assert grown < 80e6, f"stage grew by {grown / 1e6:.0f} MB"  # 572-639 MB with oneDNN's default caches (measured)


def _opt(**schema) -> dict:
    return {"anyOf": [schema, {"type": "null"}]}


# The bounds the server documents, on top of the models' types. Positive cases stay inside them, so most reach the
# engine; negative cases break them (or the types), which is where a 5xx would hide.
_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": VOCAB - 1}, "minItems": 1,
              "maxItems": 64}
_SAMPLING = {
    "model": {"type": "null"},
    "max_tokens": _opt(type="integer", minimum=1, maximum=32),
    "temperature": _opt(type="number", minimum=0, maximum=2),
    "top_p": _opt(type="number", exclusiveMinimum=0, maximum=1),
    "top_k": _opt(type="integer", minimum=-1),
    "min_p": _opt(type="number", minimum=0, maximum=1),
    "n": _opt(type="integer", minimum=1, maximum=4),
    "stop": {"anyOf": [{"type": "string", "minLength": 1},
                       {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": 4},
                       {"type": "null"}]},
    "presence_penalty": _opt(type="number", minimum=-2, maximum=2),
    "frequency_penalty": _opt(type="number", minimum=-2, maximum=2),
    "repetition_penalty": _opt(type="number", minimum=0.01, maximum=100),
    "logit_bias": {"type": "null"},
}
_BOUNDS = {
    "CompletionRequest": _SAMPLING | {
        "prompt": {"anyOf": [{"type": "string", "minLength": 1, "maxLength": 200},
                             {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 100},
                              "minItems": 1, "maxItems": 4},
                             _TOKEN_IDS, {"type": "array", "items": _TOKEN_IDS, "minItems": 1, "maxItems": 4}]},
        "logprobs": _opt(type="integer", minimum=0, maximum=20),
        "echo": {"anyOf": [{"const": False}, {"type": "null"}]},
        "suffix": {"type": "null"},
    },
    "ChatRequest": _SAMPLING | {
        "messages": {"type": "array", "items": {"$ref": "#/components/schemas/ChatMessage"}, "minItems": 1,
                     "maxItems": 4},
        "max_completion_tokens": _opt(type="integer", minimum=1, maximum=32),
        "top_logprobs": _opt(type="integer", minimum=0, maximum=20),
        "tools": {"type": "null"},
    },
    "ResponsesRequest": {
        "model": {"type": "null"},
        "input": {"anyOf": [{"type": "string", "minLength": 1, "maxLength": 200},
                            {"type": "array", "minItems": 1, "maxItems": 3, "items": {
                                "type": "object", "required": ["role", "content"],
                                "properties": {"role": {"enum": ["user", "system", "developer", "assistant"]},
                                               "content": {"anyOf": [{"type": "string", "maxLength": 200}, {
                                                   "type": "array", "maxItems": 2, "items": {
                                                       "type": "object", "required": ["type", "text"],
                                                       "properties": {"type": {"const": "input_text"},
                                                                      "text": {"type": "string"}}}}]}}}}]},
        "max_output_tokens": _opt(type="integer", minimum=1, maximum=32),
        "temperature": _opt(type="number", minimum=0, maximum=2),
        "top_p": _opt(type="number", exclusiveMinimum=0, maximum=1),
        "tools": {"type": "null"},
        "tool_choice": {"type": "null"},
        "previous_response_id": {"type": "null"},
    },
    "ChatMessage": {
        "role": {"enum": ["system", "user", "assistant"]},
        "content": {"anyOf": [{"type": "string", "maxLength": 200}, {"type": "null"},
                              {"type": "array", "maxItems": 3, "items": {
                                  "type": "object", "required": ["type", "text"],
                                  "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}}]},
    },
}


def _openapi() -> dict:
    """An OpenAPI schema of the three POST endpoints, from the pydantic models the server validates bodies with,
    narrowed to _BOUNDS. The server has no schema of its own (openapi_url=None), and its routes read the raw Request
    (to bound the body's size before parsing it), so FastAPI's would have no request bodies anyway."""
    models = [(CompletionRequest, "validation"), (ChatRequest, "validation"), (ResponsesRequest, "validation")]
    refs, defs = models_json_schema(models, ref_template="#/components/schemas/{model}")
    schemas = defs["$defs"]
    for name, props in _BOUNDS.items():
        assert props.keys() <= schemas[name]["properties"].keys(), f"_BOUNDS names a field {name} does not have"
        schemas[name]["properties"] |= props

    def post(model) -> dict:
        body = {"required": True, "content": {"application/json": {"schema": refs[(model, "validation")]}}}
        return {"post": {"requestBody": body, "responses": {"200": {"description": "OK"}}}}

    return {"openapi": "3.1.0", "info": {"title": "pipellm", "version": "test"},
            "paths": {"/v1/completions": post(CompletionRequest), "/v1/chat/completions": post(ChatRequest),
                      "/v1/responses": post(ResponsesRequest)},
            "components": {"schemas": schemas}}


SCHEMA = schemathesis.openapi.from_dict(_openapi())


def _stream_errors(resp) -> list[dict]:
    """Error events of an SSE body: once streaming, a server failure can only be said in the stream."""
    if not resp.headers.get("content-type", [""])[0].startswith("text/event-stream"):  # schemathesis: lists
        return []
    events = [json.loads(line[6:]) for line in resp.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    return [e["error"] for e in events if "error" in e]


@pytest.fixture(scope="module")
def fuzz_server(llama_dir, tmp_path_factory):
    # --max-model-len bounds every generation, so valid requests with the largest n and max_tokens stay quick.
    with serve(llama_dir, tmp_path_factory.mktemp("fuzz"), "--max-model-len", str(MAX_MODEL_LEN)) as s:
        yield s


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/responses"])
def test_fuzzed_requests_never_get_a_5xx(fuzz_server, path):
    operation = SCHEMA[path]["POST"]
    cases = st.one_of(*(operation.as_strategy(mode) for mode in schemathesis.GenerationMode))
    seen: dict[int, int] = {}
    start = time.monotonic()

    # No shrinking: a request that kills the engine makes every later one fail, so the shrunk case would be any
    # request; the first failing case is the one to report.
    @settings(max_examples=150, derandomize=True, database=None, deadline=timedelta(seconds=30),
              phases=[Phase.explicit, Phase.generate],
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large])
    @given(case=cases)
    def check(case):
        assert time.monotonic() - start < FUZZ_BUDGET_S, f"{sum(seen.values())} requests took too long: {seen}"
        resp = case.call(base_url=fuzz_server.url, timeout=30)
        seen[resp.status_code] = seen.get(resp.status_code, 0) + 1
        assert resp.status_code < 500, f"{case.body!r} -> {resp.status_code} {resp.text[:500]}"
        assert not _stream_errors(resp), f"{case.body!r} -> {_stream_errors(resp)}"

    check()
    print(f"{path}: {sum(seen.values())} requests in {time.monotonic() - start:.1f} s, statuses {seen}")
    assert seen.get(200, 0) > 10 and sum(n for s, n in seen.items() if 400 <= s < 500) > 10  # both kinds were sent
    assert httpx.get(f"{fuzz_server.url}/health").status_code == 200
    out = httpx.post(f"{fuzz_server.url}/v1/completions", json={"prompt": "Hello", "max_tokens": 2}, timeout=30)
    assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] >= 1
    assert "Traceback" not in open(fuzz_server.log).read()


@pytest.mark.parametrize("body", [
    {"prompt": "0", "repetition_penalty": 5e-324},  # took the engine down: logits / penalty overflowed to inf
    {"messages": [{"role": "user", "content": "Hi"}], "repetition_penalty": 1e300},  # inf as float32
])
def test_requests_the_fuzz_found_get_a_400(fuzz_server, body):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    resp = httpx.post(f"{fuzz_server.url}{path}", json=body, timeout=30)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] in body
    assert httpx.get(f"{fuzz_server.url}/health").status_code == 200
