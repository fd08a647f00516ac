"""`pipellm serve` as a user runs it: a real server subprocess on a loopback port, driven by the official openai client
and by httpx. The expected texts come from LLM.generate / LLM.chat on the same tiny checkpoint (llm_pp2)."""
import asyncio
import itertools
import json
import os
import shutil
import signal
import socket
import threading
import time

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from pipellm import LLM, SamplingParams, StructuredOutputsParams
from pipellm.sampling_params import BeamSearchParams
from pipellm.entrypoints.protocol import APIError
from pipellm.entrypoints.responses import Reply, ResponsesRequest, ResponseStore
from pipellm.loader.model_folder import load_tokenizer
from tests.serving import KEY, Server, is_running, serve, wait_until


NAME, MAX_MODEL_LEN = "tiny", 128
UI = "http://localhost:3000"  # --allowed-origins
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "The capital of France is"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello world! How are you?"}]


@pytest.fixture(scope="module")
def server(llama_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    with serve(llama_dir, tmp, "--api-key", KEY, "--served-model-name", NAME, "--max-model-len", str(MAX_MODEL_LEN),
               "--allowed-origins", UI,
               "--trace-dir", str(tmp / "trace")) as s:
        yield s


def _greedy(llm, prompt, **kw):
    return llm.generate(prompt, SamplingParams(temperature=0.0, **kw), use_tqdm=False)[0]


def _metrics(server: Server) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics", headers=AUTH).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = s.name + "".join(f"[{v}]" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[key] = s.value
    return out


def _when_all_ended(server: Server, before: dict) -> tuple[dict, int]:
    """Once no request runs or waits: the metrics, with the KV cache checked empty, and the completions aborted
    since `before` (metrics too)."""
    def idle():
        m = _metrics(server)
        return m["pipellm:num_requests_running"] == 0 and m["pipellm:num_requests_waiting"] == 0
    wait_until(idle, 15, "every request to end")
    after = _metrics(server)
    assert after["pipellm:kv_cache_usage_perc"] == 0.0
    key = "pipellm:request_finished_total[abort]"
    return after, after.get(key, 0) - before.get(key, 0)


def _still_serves(server: Server) -> None:
    out = server.client().completions.create(model=NAME, prompt="Hello", max_tokens=2)
    assert out.usage.completion_tokens >= 1


# ---- the OpenAI API ---------------------------------------------------------------------------------------------

def test_only_the_allowed_origins_may_call_from_a_browser(server):
    asks = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
    ok = httpx.options(f"{server.url}/v1/chat/completions", headers={"Origin": UI} | asks)
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == UI
    assert "authorization" in ok.headers["access-control-allow-headers"].lower()
    other = httpx.options(f"{server.url}/v1/chat/completions", headers={"Origin": "http://evil.example"} | asks)
    assert "access-control-allow-origin" not in other.headers
    answer = httpx.get(f"{server.url}/v1/models", headers=AUTH | {"Origin": UI})
    assert answer.headers["access-control-allow-origin"] == UI
    assert "access-control-allow-origin" not in httpx.get(f"{server.url}/v1/models", headers=AUTH | {
        "Origin": "http://evil.example"}).headers


def test_models_health_version(server):
    with open(server.log) as f:
        assert f"serving {NAME} at {server.url}/v1\n" in f.read()  # where it listens, --port 0 included
    assert [m.id for m in server.client().models.list().data] == [NAME]
    health = httpx.get(f"{server.url}/health").json()
    assert health["status"] == "ok" and len(health["stages"]) == 2
    assert httpx.get(f"{server.url}/version").json()["version"]


def test_completion_greedy_matches_llm_generate(server, llm_pp2):
    expected = _greedy(llm_pp2, PROMPT, max_tokens=12).outputs[0]
    out = server.client().completions.create(model=NAME, prompt=PROMPT, max_tokens=12, temperature=0)
    assert out.choices[0].text == expected.text
    assert out.choices[0].finish_reason == expected.finish_reason
    assert out.usage.prompt_tokens == len(llm_pp2.get_tokenizer().encode(PROMPT))
    assert out.usage.completion_tokens == len(expected.token_ids)

    stream = server.client().completions.create(model=NAME, prompt=PROMPT, max_tokens=12, temperature=0,
                                                stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == expected.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected.token_ids)
    assert chunks[-1].usage.prompt_tokens == out.usage.prompt_tokens


def test_chat_greedy_matches_llm_chat(server, llm_pp2):
    expected = llm_pp2.chat(MESSAGES, SamplingParams(temperature=0.0, max_tokens=10), use_tqdm=False)[0]
    out = server.client().chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=10, temperature=0)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == expected.outputs[0].text
    assert out.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert out.usage.completion_tokens == len(expected.outputs[0].token_ids)

    chunks = list(server.client().chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=10,
                                                          temperature=0, stream=True,
                                                          stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.outputs[0].text
    assert chunks[-1].usage.total_tokens == out.usage.total_tokens


def test_prompt_forms(server, llm_pp2):
    tok = llm_pp2.get_tokenizer()
    prompts = [PROMPT, "Once upon a time"]
    expected = [_greedy(llm_pp2, p, max_tokens=5).outputs[0].text for p in prompts]
    client = server.client()
    for prompt in (prompts, [tok.encode(p) for p in prompts]):
        out = client.completions.create(model=NAME, prompt=prompt, max_tokens=5, temperature=0)
        assert [c.text for c in sorted(out.choices, key=lambda c: c.index)] == expected
    out = client.completions.create(model=NAME, prompt=tok.encode(PROMPT), max_tokens=5, temperature=0)
    assert out.choices[0].text == expected[0]


def test_n2_seeded_matches_llm(server, llm_pp2):
    params = SamplingParams(n=2, temperature=0.9, seed=7, max_tokens=8)
    expected = llm_pp2.generate(PROMPT, params, use_tqdm=False)[0].outputs
    out = server.client().completions.create(model=NAME, prompt=PROMPT, n=2, temperature=0.9, seed=7,
                                             max_tokens=8)
    assert [c.index for c in out.choices] == [0, 1]
    assert [c.text for c in out.choices] == [e.text for e in expected]
    assert out.usage.completion_tokens == sum(len(e.token_ids) for e in expected)
    stream = server.client().chat.completions.create(model=NAME, messages=MESSAGES, n=2, max_tokens=6, stream=True)
    finished = {c.choices[0].index for c in stream if c.choices and c.choices[0].finish_reason}
    assert finished == {0, 1}


def test_stop_string_cuts_text_in_both_modes(server, llm_pp2):
    full = _greedy(llm_pp2, PROMPT, max_tokens=24, ignore_eos=True).outputs[0].text
    stop = full[6:8]
    expected = _greedy(llm_pp2, PROMPT, max_tokens=24, ignore_eos=True, stop=[stop]).outputs[0]
    assert expected.finish_reason == "stop" and expected.text == full[:full.find(stop)]
    client = server.client()
    extra = {"ignore_eos": True}
    out = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=24, temperature=0, stop=stop,
                                    extra_body=extra)
    assert (out.choices[0].text, out.choices[0].finish_reason) == (expected.text, "stop")
    chunks = list(client.completions.create(model=NAME, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop],
                                            stream=True, extra_body=extra))
    assert "".join(c.choices[0].text for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_logit_bias_min_tokens_and_stop_options_match_llm(server, llm_pp2):
    tok = llm_pp2.get_tokenizer()
    plain = _greedy(llm_pp2, PROMPT, max_tokens=8, ignore_eos=True).outputs[0]
    bias = {plain.token_ids[0]: -100.0, plain.token_ids[2]: 3.0}
    expected = _greedy(llm_pp2, PROMPT, max_tokens=8, ignore_eos=True, logit_bias=bias).outputs[0]
    assert expected.token_ids != plain.token_ids
    client = server.client()
    out = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=8, temperature=0,
                                    logit_bias={str(t): b for t, b in bias.items()}, extra_body={"ignore_eos": True})
    assert out.choices[0].text == expected.text
    out = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=8, temperature=0,
                                         logit_bias={str(t): b for t, b in bias.items()})
    assert out.choices[0].message.content == llm_pp2.chat(MESSAGES, SamplingParams(
        temperature=0.0, max_tokens=8, logit_bias=bias), use_tqdm=False)[0].outputs[0].text
    # vLLM's extra parameters: a stop token held off by min_tokens, a stop string kept in the text.
    stop_id, stop = plain.token_ids[1], tok.decode(plain.token_ids[3:5])
    expected = _greedy(llm_pp2, PROMPT, max_tokens=8, min_tokens=3, stop_token_ids=[stop_id]).outputs[0]
    assert len(expected.token_ids) >= 3
    out = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=8, temperature=0,
                                    extra_body={"min_tokens": 3, "stop_token_ids": [stop_id]})
    assert out.choices[0].text == expected.text and out.usage.completion_tokens == len(expected.token_ids)
    words = [tok.decode(plain.token_ids[1:2]).strip()]
    expected = _greedy(llm_pp2, PROMPT, max_tokens=8, ignore_eos=True, bad_words=words,
                       allowed_token_ids=list(range(300))).outputs[0]
    out = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=8, temperature=0, extra_body={
        "ignore_eos": True, "bad_words": words, "allowed_token_ids": list(range(300))})
    assert out.choices[0].text == expected.text != plain.text
    expected = _greedy(llm_pp2, PROMPT, max_tokens=8, ignore_eos=True, stop=[stop],
                       include_stop_str_in_output=True).outputs[0]
    assert expected.text.endswith(stop)
    for stream in (False, True):
        out = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=8, temperature=0, stop=[stop],
                                        stream=stream,
                                        extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
        text = "".join(c.choices[0].text for c in out) if stream else out.choices[0].text
        assert text == expected.text
    ids = tok.encode("Once upon a time " * 40)  # longer than the server's max_model_len
    expected = _greedy(llm_pp2, {"prompt_token_ids": ids[-30:]}, max_tokens=4, ignore_eos=True).outputs[0]
    for echo in (False, True):
        out = client.completions.create(model=NAME, prompt=ids, max_tokens=4, temperature=0, echo=echo,
                                        extra_body={"ignore_eos": True, "truncate_prompt_tokens": 30})
        assert out.usage.prompt_tokens == 30
        assert out.choices[0].text == (tok.decode(ids[-30:]) if echo else "") + expected.text
    for bad, why in (({"x": 1}, "keys must be token ids"), ({"-3": 1}, "logit_bias"), ({"5": 500}, "logit_bias"),
                     ({"100000": 1}, "outside")):
        with pytest.raises(openai.BadRequestError, match=why):
            client.completions.create(model=NAME, prompt=PROMPT, max_tokens=2, logit_bias=bad)
    with pytest.raises(openai.BadRequestError, match="min_tokens"):
        client.completions.create(model=NAME, prompt=PROMPT, max_tokens=2, extra_body={"min_tokens": 3})
    _still_serves(server)


def test_use_beam_search_matches_llm_beam_search(server, llm_pp2):
    tok, client = llm_pp2.get_tokenizer(), server.client()
    chat_prompt = llm_pp2.chat(MESSAGES, SamplingParams(max_tokens=1), use_tqdm=False)[0].prompt_token_ids
    for prompt, ignore_eos in ((tok.encode(PROMPT), True), (tok.encode(PROMPT), False), (chat_prompt, False)):
        [want] = llm_pp2.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(
            beam_width=3, max_tokens=8, ignore_eos=ignore_eos, length_penalty=0.5))
        new = [s.tokens[len(prompt):] for s in want.sequences]
        new = [t[:-1] if s.finish_reason == "stop" else t for t, s in zip(new, want.sequences)]  # no EOS in the text
        texts = [tok.decode(t, skip_special_tokens=True) for t in new]
        reasons = [s.finish_reason for s in want.sequences]
        extra = {"use_beam_search": True, "length_penalty": 0.5, "ignore_eos": ignore_eos}
        for stream in (False, True):
            if prompt is chat_prompt:
                out = client.chat.completions.create(model=NAME, messages=MESSAGES, n=3, max_tokens=8, temperature=0,
                                                     stream=stream, extra_body=extra)
                got = _joined(out, stream, lambda c: c.delta.content or "", lambda c: c.message.content)
            else:
                out = client.completions.create(model=NAME, prompt=prompt, n=3, max_tokens=8, temperature=0,
                                                stream=stream, extra_body=extra)
                got = _joined(out, stream, lambda c: c.text, lambda c: c.text)
            assert got == (texts, reasons)
            if not stream:
                assert out.usage.completion_tokens == sum(len(t) for t in new)


def test_use_beam_search_ends_beams_at_eos_and_priorities_reach_the_engine(llama_dir, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(llama_dir, model)
    eos = 303  # the fourth token of the best beams after PROMPT: here it ends some of them
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, eos]}))
    tok = load_tokenizer(str(model))
    prompt = tok.encode(PROMPT)
    with LLM(str(model), dtype="float32") as llm:
        [want] = llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(beam_width=3, max_tokens=8))
        greedy = _greedy(llm, PROMPT, max_tokens=8).outputs[0]
    assert "stop" in [s.finish_reason for s in want.sequences]
    with serve(str(model), tmp_path, "--scheduling-policy", "priority") as s:
        out = s.client().completions.create(model=str(model), prompt=PROMPT, max_tokens=8, temperature=0,
                                            extra_body={"priority": -3})
        assert out.choices[0].text == greedy.text
        for keep_eos in (False, True):
            out = s.client().completions.create(model=str(model), prompt=PROMPT, n=3, max_tokens=8, temperature=0,
                                                extra_body={"use_beam_search": True, "priority": 2,
                                                            "include_stop_str_in_output": keep_eos})
            new = [w.tokens[len(prompt):] for w in want.sequences]
            new = [t if keep_eos or w.finish_reason == "length" else t[:-1] for t, w in zip(new, want.sequences)]
            assert [(c.text, c.finish_reason) for c in out.choices] == [
                (tok.decode(t, skip_special_tokens=True), w.finish_reason) for t, w in zip(new, want.sequences)]
            assert out.usage.completion_tokens == sum(len(t) for t in new)


def test_use_beam_search_logprobs_are_hf_log_softmax(server, llm_pp2, checkpoints):
    """Each beam token's log-probability and its step's top k are HF's log-softmax after the tokens before it. A k
    past the 2n a step ranks widens the step and leaves the beams where they were."""
    hf, tok, client = checkpoints["llama"][1], llm_pp2.get_tokenizer(), server.client()
    beams = BeamSearchParams(beam_width=2, max_tokens=5, ignore_eos=True)
    extra = {"use_beam_search": True, "ignore_eos": True}
    chat_prompt = llm_pp2.chat(MESSAGES, SamplingParams(max_tokens=1), use_tqdm=False)[0].prompt_token_ids
    for prompt, k in ((tok.encode(PROMPT), 3), (tok.encode(PROMPT), 6), (chat_prompt, 2), (chat_prompt, 5)):
        [want] = llm_pp2.beam_search([{"prompt_token_ids": prompt}], beams)
        if prompt is chat_prompt:
            out = client.chat.completions.create(model=NAME, messages=MESSAGES, n=2, max_tokens=5, temperature=0,
                                                 logprobs=True, top_logprobs=k, extra_body=extra)
            got = [([c.logprob for c in ch.logprobs.content],
                    [[t.logprob for t in c.top_logprobs] for c in ch.logprobs.content]) for ch in out.choices]
            assert [ch.message.content for ch in out.choices] == [tok.decode(s.tokens[len(prompt):],
                                                                              skip_special_tokens=True)
                                                                   for s in want.sequences]
        else:
            out = client.completions.create(model=NAME, prompt=prompt, n=2, max_tokens=5, temperature=0, logprobs=k,
                                            extra_body=extra)
            got = [(ch.logprobs.token_logprobs, None) for ch in out.choices]
            assert [ch.text for ch in out.choices] == [tok.decode(s.tokens[len(prompt):], skip_special_tokens=True)
                                                       for s in want.sequences]
        for (token_lps, tops), seq in zip(got, want.sequences):
            with torch.no_grad():
                lp = hf(torch.tensor([seq.tokens])).logits[0, len(prompt) - 1:-1].float().log_softmax(-1)
            new = torch.tensor(seq.tokens[len(prompt):])
            assert token_lps == pytest.approx(lp.gather(-1, new[:, None])[:, 0].tolist(), abs=1e-4)
            if tops is not None:
                assert tops == [pytest.approx(row.topk(k).values.tolist(), abs=1e-4) for row in lp]


def _joined(out, stream: bool, chunk_text, choice_text) -> tuple[list[str], list[str]]:
    """Each choice's text and finish reason, from a response or a stream of chunks."""
    choices = [c for chunk in out for c in chunk.choices] if stream else out.choices
    n = max(c.index for c in choices) + 1
    return (["".join(chunk_text(c) if stream else choice_text(c) for c in choices if c.index == i) for i in range(n)],
            [[c.finish_reason for c in choices if c.index == i and c.finish_reason][-1] for i in range(n)])


def test_use_beam_search_errors(server):
    client = server.client()
    for extra, why in (({"top_p": 0.5}, "takes no top_p"), ({"stop": ["."]}, "takes no stop"),
                       ({"echo": True}, "takes no echo"), ({"n": 11}, "n=11 ranks the top 22"),
                       ({"use_beam_search": False, "length_penalty": 2.0}, "give use_beam_search=true")):
        with pytest.raises(openai.BadRequestError, match=why):
            client.completions.create(model=NAME, prompt=PROMPT, max_tokens=2,
                                      extra_body={"use_beam_search": True} | extra)
    with pytest.raises(openai.BadRequestError, match=r"takes no stop \(here \['\.'\]\)"):
        client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=2, stop=["."],
                                       extra_body={"use_beam_search": True})
    # neutral values pass, as clients send them
    out = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=2, top_p=1.0, presence_penalty=0, n=2,
                                    extra_body={"use_beam_search": True})
    assert len(out.choices) == 2


def _posted_completion(server: Server, body: dict) -> socket.socket:
    """A socket that sent POST /v1/completions with body and reads no answer: closing it hangs up."""
    data = json.dumps(body).encode()
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: %d\r\n\r\n" % len(data) + data)
    return sock


def test_client_gone_during_a_beam_search_ends_it(server):
    # 120 steps of 4 beams: 480 tokens
    with _posted_completion(server, {"model": NAME, "prompt": PROMPT, "max_tokens": 120, "n": 4, "ignore_eos": True,
                                     "use_beam_search": True}):
        wait_until(lambda: _metrics(server)["pipellm:generation_tokens_total"] > 0, 10, "the search to run")
        before = _metrics(server)["pipellm:generation_tokens_total"]
        wait_until(lambda: _metrics(server)["pipellm:generation_tokens_total"] >= before + 8, 20, "a few steps")
    wait_until(lambda: _metrics(server)["pipellm:num_requests_running"] == 0, 10, "the step's requests to end")
    time.sleep(0.5)  # past a step's end, where none runs for a moment
    stopped = _metrics(server)["pipellm:generation_tokens_total"]
    assert stopped - before < 100  # it ended a few steps after the hang-up, far from its 120
    time.sleep(1.0)
    after = _metrics(server)
    assert after["pipellm:generation_tokens_total"] == stopped  # and no step ran after
    assert after["pipellm:kv_cache_usage_perc"] == 0.0


def test_response_format_and_structured_outputs(server, llm_pp2):
    schema = {"type": "object", "additionalProperties": False, "required": ["ok", "colour"],
              "properties": {"ok": {"type": "boolean"}, "colour": {"enum": ["red", "green", "blue"]}}}
    expected = llm_pp2.chat(MESSAGES, SamplingParams(temperature=0.0, max_tokens=32, structured_outputs=(
        StructuredOutputsParams(json=schema))), use_tqdm=False)[0].outputs[0].text
    assert set(json.loads(expected)) == {"ok", "colour"}
    client = server.client()
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    out = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=32, temperature=0,
                                         response_format=fmt)
    assert out.choices[0].message.content == expected and out.choices[0].finish_reason == "stop"
    chunks = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=32, temperature=0,
                                            response_format=fmt, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    out = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=16, n=3, temperature=1.0, seed=2,
                                    extra_body={"structured_outputs": {"choice": ["Paris", "Rome"]}})
    assert {c.text for c in out.choices} <= {"Paris", "Rome"}
    for body, why in (({"response_format": {"type": "xml"}}, "response_format: give"),
                      ({"structured_outputs": {"regex": "a(b"}}, "unclosed group"),
                      ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one of"),
                      ({"structured_outputs": {"jsonn": "{}"}}, "unexpected keyword"),
                      ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
                       "not both")):
        with pytest.raises(openai.BadRequestError, match=why):
            client.completions.create(model=NAME, prompt=PROMPT, max_tokens=2, extra_body=body)
    _still_serves(server)


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "additionalProperties": False,
                                                           "required": ["city"],
                                                           "properties": {"city": {"enum": ["Paris", "Rome"]}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "additionalProperties": False, "properties": {"utc": {"type": "boolean"}}, "required": ["utc"]}}}


def test_a_named_tool_choice_gives_its_call(server):
    """Its arguments held to its schema; the same call, whole, in the last chunk of a stream. ("required" and the
    hermes parser: tests/test_tools.py.)"""
    client, hi = server.client(), [{"role": "user", "content": "Hi"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    for seed in range(3):
        out = client.chat.completions.create(model=NAME, messages=hi, max_tokens=48, temperature=1.0, seed=seed,
                                             tools=[WEATHER, TIME], tool_choice=named)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        [call] = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather" and call.id
        assert json.loads(call.function.arguments) in ({"city": "Paris"}, {"city": "Rome"})
        chunks = list(client.chat.completions.create(model=NAME, messages=hi, max_tokens=48, temperature=1.0,
                                                     seed=seed, tools=[WEATHER, TIME], tool_choice=named,
                                                     stream=True))
        [streamed] = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
        assert (streamed.index, streamed.function.name, streamed.function.arguments) == \
               (0, "get_weather", call.function.arguments)
        assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_responses_api_greedy_matches_llm_chat(server, llm_pp2):
    """OpenAI's Responses API: instructions and input as the chat's messages, the reply as the output message;
    streamed, the same text in output_text deltas between the events that open and close it, numbered."""
    expected = llm_pp2.chat(MESSAGES, SamplingParams(temperature=0.0, max_tokens=10), use_tqdm=False)[0].outputs[0]
    client = server.client()
    kwargs = dict(model=NAME, instructions=MESSAGES[0]["content"], input=MESSAGES[1]["content"],
                  max_output_tokens=10, temperature=0)
    out = client.responses.create(**kwargs)
    [message] = out.output
    assert (message.type, message.role, out.output_text) == ("message", "assistant", expected.text)
    assert out.status == ("incomplete" if expected.finish_reason == "length" else "completed")
    assert out.usage.output_tokens == len(expected.token_ids) and out.model == NAME
    events = list(client.responses.create(stream=True, **kwargs))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:4]] + [e.type for e in events[-4:]] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        f"response.{out.status}"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == expected.text
    assert events[-1].response.output_text == expected.text and events[-1].response.usage == out.usage
    # the same conversation as items: a developer message is the system's, a message's text parts its content
    items = [{"role": "developer", "content": MESSAGES[0]["content"]},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": MESSAGES[1]["content"]}]}]
    again = client.responses.create(model=NAME, input=items, max_output_tokens=10, temperature=0)
    assert again.output_text == expected.text and again.usage == out.usage


def test_responses_api_function_calls_and_their_outputs(server):
    """A named tool_choice gives its function_call item (arguments held to its schema), streamed as one; the call
    and its output, sent back as input items, reach the chat template as the assistant's call and a tool message."""
    client = server.client()
    tool = {"type": "function"} | WEATHER["function"]
    kwargs = dict(model=NAME, input="Weather?", max_output_tokens=48, tools=[tool],
                  tool_choice={"type": "function", "name": "get_weather"}, temperature=0)
    out = client.responses.create(**kwargs)
    [call] = out.output
    assert (call.type, call.name, call.status) == ("function_call", "get_weather", "completed") and call.call_id
    assert json.loads(call.arguments) in ({"city": "Paris"}, {"city": "Rome"})
    events = list(client.responses.create(stream=True, **kwargs))
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert (done.name, done.arguments) == ("get_weather", call.arguments)
    assert [i.type for i in events[-1].response.output] == ["function_call"]
    turn = [{"role": "user", "content": "Weather?"},
            {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"}]
    follow = client.responses.create(model=NAME, input=turn, max_output_tokens=2, tools=[tool], tool_choice="none")
    chat = [{"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": call.call_id, "type": "function", "function": {"name": call.name,
                                                                      "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny"}]
    same = client.chat.completions.create(model=NAME, messages=chat, max_tokens=2, tools=[WEATHER], tool_choice="none")
    assert follow.usage.input_tokens == same.usage.prompt_tokens


def test_responses_api_continues_a_kept_response(server):
    """previous_response_id continues a kept response as if the conversation so far came as input (the earlier
    turn's instructions not carried, as OpenAI's); GET gives a response back as it was made, streamed or not, and
    lists its own input items; a response made with store=false, or deleted, cannot be read or continued."""
    client = server.client()
    kwargs = dict(model=NAME, max_output_tokens=6, temperature=0)
    first = client.responses.create(instructions="Be brief.", input="Hello world!", **kwargs)
    second = client.responses.create(previous_response_id=first.id, input="How are you?", **kwargs)
    sent = [{"role": "user", "content": "Hello world!"}, {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "How are you?"}]
    whole = client.responses.create(input=sent, store=False, **kwargs)
    assert (second.output_text, second.usage) == (whole.output_text, whole.usage)
    assert (second.previous_response_id, second.store, whole.store) == (first.id, True, False)
    events = list(client.responses.create(previous_response_id=second.id, input="Bye", stream=True, **kwargs))
    third = events[-1].response
    whole = client.responses.create(input=sent + [{"role": "assistant", "content": second.output_text},
                                                  {"role": "user", "content": "Bye"}], store=False, **kwargs)
    assert (third.output_text, third.usage) == (whole.output_text, whole.usage)
    for made in (first, second, third):
        assert client.responses.retrieve(made.id).model_dump() == made.model_dump()
    [item] = client.responses.input_items.list(second.id).data
    assert (item.type, item.role, item.content[0].text) == ("message", "user", "How are you?")
    with pytest.raises(openai.NotFoundError, match="not found"):
        client.responses.retrieve(whole.id)
    with pytest.raises(openai.NotFoundError, match=whole.id):
        client.responses.create(previous_response_id=whole.id, input="Hi", **kwargs)
    client.responses.delete(first.id)
    for gone in (lambda: client.responses.retrieve(first.id), lambda: client.responses.delete(first.id),
                 lambda: client.responses.create(previous_response_id=third.id, input="Hi", **kwargs)):
        with pytest.raises(openai.NotFoundError, match=first.id):  # a conversation needs each of its turns
            gone()
    assert client.responses.retrieve(second.id).id == second.id


def test_the_response_store_keeps_the_last_responses_used():
    """--responses-store-size N keeps the last N responses made, read or continued; a conversation with a turn
    dropped cannot go on, and size 0 keeps none (saying which flag keeps some)."""
    store = ResponseStore(2)

    def made(previous: Reply | None = None) -> Reply:
        reply = Reply(ResponsesRequest(input="Hi", previous_response_id=previous and previous.head["id"]), NAME, True)
        reply.from_chat({"choices": [{"message": {"content": "Hello"}, "finish_reason": "stop"}],
                         "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})
        store.put(reply, [{"type": "message", "role": "user", "content": "Hi", "id": "msg_1"}])
        return reply

    first = made()
    second = made(first)
    store.get(first.head["id"])  # read: second is now the oldest
    third = made()
    assert list(store.kept) == [first.head["id"], third.head["id"]]
    with pytest.raises(APIError, match="keeps the last 2"):
        store.get(second.head["id"])
    fourth = made(third)
    assert len(store.history(fourth.head["id"])) == 4  # two turns: an input and an output item each
    fifth = made(fourth)  # a conversation's oldest turn goes first
    with pytest.raises(APIError, match=third.head["id"]):
        store.history(fifth.head["id"])
    with pytest.raises(APIError, match="--responses-store-size") as e:
        ResponseStore(0).history("resp_1")
    assert e.value.status == 400


def test_responses_api_background_mode(server):
    """background=true answers at once; the response runs, polled with GET, to the same reply as in the
    foreground; cancelled while it runs, its request is aborted and its KV blocks freed."""
    client = server.client()
    kwargs = dict(model=NAME, input=PROMPT, max_output_tokens=8, temperature=0)
    expected = client.responses.create(store=False, **kwargs)
    started = client.responses.create(background=True, **kwargs)
    assert started.background and started.status in ("queued", "in_progress")
    wait_until(lambda: client.responses.retrieve(started.id).status not in ("queued", "in_progress"), 30,
               "the background response to end")
    done = client.responses.retrieve(started.id)
    assert (done.status, done.output_text, done.usage) == (expected.status, expected.output_text, expected.usage)
    before = _metrics(server)
    long = client.responses.create(background=True, model=NAME, input=PROMPT, max_output_tokens=96,
                                   extra_body={"ignore_eos": True})
    wait_until(lambda: client.responses.retrieve(long.id).output, 10, "the reply to begin")  # its output so far
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled" and cancelled.output_text
    assert _when_all_ended(server, before)[1] == 1
    assert client.responses.retrieve(long.id).status == "cancelled"
    with pytest.raises(openai.BadRequestError, match="only a background response"):
        client.responses.cancel(client.responses.create(**kwargs).id)


def test_responses_api_refuses_what_it_cannot_run(server):
    url = f"{server.url}/v1/responses"
    for body, param, words in [
            ({"input": "Hi", "previous_response_id": "resp_1"}, "previous_response_id", "'resp_1' not found"),
            ({"input": "Hi", "background": True, "store": False}, "background", "give store=true"),
            ({"input": "Hi", "background": True, "stream": True}, "background", "not both"),
            ({"input": []}, "input", "input is empty"),
            ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input",
             "text parts only"),
            ({"input": [{"type": "computer_call"}]}, "input", "give message, function_call"),
            ({"input": [{"type": "function_call", "name": "f"}]}, "input", "needs 'call_id'"),
            ({"input": [1]}, "input", "an item is an object"),
            ({"input": "Hi", "tools": [{"type": "web_search"}]}, "tools", "function tools"),
            ({"input": "Hi", "tools": [{"type": "function", "name": "f", "parameters": "x"}]}, "tools", "JSON schema"),
            ({"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text", "needs its 'schema'"),
            ({"input": "Hi", "text": {"format": {"type": "yaml"}}}, "text", "give text, json_object or json_schema"),
            ({"input": "Hi", "max_output_tokens": 0}, "max_output_tokens", "max_output_tokens"),
            ({"input": "Hi", "model": "gpt-5"}, "model", "does not exist")]:
        err = _error(httpx.post(url, json=body, headers=AUTH), 404 if param in ("model", "previous_response_id")
                     else 400)
        assert err["param"] == param and words in err["message"], (body, err)
    made = server.client().responses.create(model=NAME, input="Hi", max_output_tokens=1)
    for path, query, param in [("resp_1", {}, None), (made.id, {"stream": "true"}, "stream"),
                               (f"{made.id}/input_items", {"limit": "0"}, "limit"),
                               (f"{made.id}/input_items", {"order": "up"}, "order"),
                               (f"{made.id}/input_items", {"after": "msg_1"}, "after")]:
        err = _error(httpx.get(f"{url}/{path}", params=query, headers=AUTH), 400 if param else 404)
        assert err["param"] == param, (path, query, err)
    _error(httpx.post(url, json={"input": "Hi"}), 401)
    _error(httpx.get(f"{url}/{made.id}"), 401)
    _still_serves(server)


def test_auto_tool_choice_and_reasoning_parsers(llama_dir, tmp_path):
    """`--enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser qwen3`: a reply that writes a
    <tool_call> comes back as the call, a <think> block as reasoning_content, streamed or not; plain text as text.
    The replies are held to those texts by structured outputs (a random model would write neither)."""
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
    hi = [{"role": "user", "content": "Hi"}]
    # --chat-template too, with a variable for chat_template_kwargs
    template = "{% for m in messages %}<<{{ m['role'] }}>>{{ m['content'] }}{% endfor %}{% if x %}[{{ x }}]{% endif %}"
    with serve(llama_dir, tmp_path, "-pp", "1", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
               "--reasoning-parser", "qwen3", "--chat-template", template) as srv:
        client = srv.client()
        model = client.models.list().data[0].id
        tok = load_tokenizer(llama_dir)
        for body, text in (({}, "<<user>>Hi"), ({"chat_template_kwargs": {"x": "y"}}, "<<user>>Hi[y]")):
            ids = httpx.post(f"{srv.url}/tokenize", json={"messages": hi} | body).json()["tokens"]
            assert ids == tok.encode(text, add_special_tokens=False)
        weather = [("get_weather", {"city": "Rome"})]
        tools = [{"type": "function"} | t["function"] for t in (WEATHER, TIME)]
        for text, reasoning, content, calls in ((f"Sure. {call}", None, "Sure.", weather),
                                                ("It is noon.", None, "It is noon.", []),
                                                ("<think>Rome, then.</think>\n" + call, "Rome, then.", None, weather),
                                                ("<think>Easy.</think>\n\nIt is noon.", "Easy.", "It is noon.", [])):
            kwargs = dict(model=model, messages=hi, max_tokens=160, tools=[WEATHER, TIME],
                          extra_body={"structured_outputs": {"choice": [text]}})
            out = client.chat.completions.create(**kwargs).choices[0]
            chunks = [c.choices[0] for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
            streamed = ([tc for c in chunks for tc in c.delta.tool_calls or []],
                        "".join(c.delta.content or "" for c in chunks) or None,
                        "".join(getattr(c.delta, "reasoning_content", None) or "" for c in chunks) or None,
                        chunks[-1].finish_reason)
            for got_calls, got_content, got_reasoning, finish in (
                    (out.message.tool_calls or [], out.message.content, out.message.reasoning_content,
                     out.finish_reason), streamed):
                assert [(c.function.name, json.loads(c.function.arguments)) for c in got_calls] == calls
                assert finish == ("tool_calls" if calls else "stop")
                assert (got_content and got_content.strip() or None, got_reasoning) == (content, reasoning)
            # the Responses API: the same reply as its output items, streamed or not
            replies = [client.responses.create(model=model, input="Hi", max_output_tokens=160, tools=tools,
                                               extra_body={"structured_outputs": {"choice": [text]}})]
            events = list(client.responses.create(model=model, input="Hi", max_output_tokens=160, tools=tools,
                                                  stream=True, extra_body={"structured_outputs": {"choice": [text]}}))
            replies.append(events[-1].response)
            assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == (reasoning or "")
            for reply in replies:
                assert [(i.name, json.loads(i.arguments)) for i in reply.output if i.type == "function_call"] == calls
                thoughts = [i.content[0].text for i in reply.output if i.type == "reasoning"]
                assert thoughts == ([reasoning] if reasoning else [])
                assert (reply.output_text.strip() or None) == content


def test_gpt_oss_harmony_replies(tmp_path):
    """A GPT-OSS model's harmony reply, with no --reasoning-parser given: the analysis channel comes back as
    reasoning_content, the final channel as content, a message to functions.NAME as the call (--tool-call-parser
    openai), streamed or not, with no marker left in the text (they are special tokens). The replies are held to those
    texts by a grammar."""
    from transformers import AutoTokenizer

    from tests.test_families import make_family_checkpoint
    folder = str(tmp_path / "gpt_oss")
    make_family_checkpoint("gpt_oss", folder)
    tok = AutoTokenizer.from_pretrained(folder)
    markers = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>"]
    tok.add_special_tokens({"additional_special_tokens": markers})
    tok.save_pretrained(folder)
    ids = dict(zip(markers, tok.convert_tokens_to_ids(markers)))
    with open(os.path.join(folder, "generation_config.json"), "w") as f:  # as gpt-oss's: <|return|>, <|call|> end
        json.dump({"eos_token_id": [0, ids["<|return|>"], ids["<|call|>"]]}, f)

    def held_to(*parts: str) -> dict:  # a lark grammar: markers as the special tokens, the rest as text
        return {"structured_outputs": {"grammar": "start: " + " ".join(p if p in ids else json.dumps(p)
                                                                          for p in parts)}}
    think = ("<|channel|>", "analysis", "<|message|>", "Rome, then.", "<|end|>", "<|start|>", "assistant")
    final = ("<|channel|>", "final", "<|message|>", "It is noon.", "<|return|>")
    call = (" to=functions.get_weather", "<|channel|>", "commentary ", "<|constrain|>", "json", "<|message|>",
            '{"city": "Rome"}', "<|call|>")
    weather = [("get_weather", {"city": "Rome"})]
    # a thought sent back in a conversation reaches the template, under Qwen3's name and GPT-OSS's
    template = "{% for m in messages %}<{{ m.role }}>{{ m.thinking }}|{{ m.reasoning_content }}|{{ m.content }}" \
               "{% endfor %}"
    with serve(folder, tmp_path, "-pp", "1", "--enable-auto-tool-choice", "--tool-call-parser", "openai",
               "--chat-template", template) as srv:
        turns = [{"role": "user", "content": "Hi"},
                 {"role": "assistant", "content": "Noon.", "reasoning_content": "Easy."}]
        body = {"messages": turns, "add_generation_prompt": False}
        assert httpx.post(f"{srv.url}/tokenize", json=body).json()["tokens"] \
            == tok.encode("<user>||Hi<assistant>Easy.|Easy.|Noon.", add_special_tokens=False)
        client = srv.client()
        model = client.models.list().data[0].id
        ask = dict(model=model, messages=[{"role": "user", "content": "Hi"}], tools=[WEATHER, TIME])

        def both_ways(**kwargs) -> list[tuple]:  # (calls, content, reasoning, finish_reason), whole and streamed
            out = client.chat.completions.create(**ask, **kwargs).choices[0]
            chunks = [c.choices[0] for c in client.chat.completions.create(stream=True, **ask, **kwargs) if c.choices]
            return [(out.message.tool_calls or [], out.message.content or None, out.message.reasoning_content,
                     out.finish_reason),
                    ([tc for c in chunks for tc in c.delta.tool_calls or []],
                     "".join(c.delta.content or "" for c in chunks) or None,
                     "".join(getattr(c.delta, "reasoning_content", None) or "" for c in chunks) or None,
                     chunks[-1].finish_reason)]

        for grammar, reasoning, content, calls in ((held_to(*think, *final), "Rome, then.", "It is noon.", []),
                                                   (held_to(*final), None, "It is noon.", []),
                                                   (held_to(*think, *call), "Rome, then.", None, weather),
                                                   (held_to(*call), None, None, weather)):  # recipient first
            for got_calls, got_content, got_reasoning, finish in both_ways(max_tokens=100, extra_body=grammar):
                assert [(c.function.name, json.loads(c.function.arguments)) for c in got_calls] == calls
                assert finish == ("tool_calls" if calls else "stop")
                assert (got_content, got_reasoning) == (content, reasoning)
        # cut off by max_tokens in the call's body: no call, its text as content, finish_reason "length"
        whole = client.chat.completions.create(**ask, max_tokens=100, extra_body=held_to(*call))
        for got_calls, got_content, _, finish in both_ways(max_tokens=whole.usage.completion_tokens - 2,
                                                           extra_body=held_to(*call)):
            assert (got_calls, finish) == ([], "length") and '{"city": "Rome"}'.startswith(got_content)
        # a named function: the reply is held to its JSON, which ends with an EOS token the text leaves out
        named = {"type": "function", "function": {"name": "get_weather"}}
        for got_calls, got_content, got_reasoning, finish in both_ways(max_tokens=60, tool_choice=named):
            assert [c.function.name for c in got_calls] == ["get_weather"] and finish == "tool_calls"
            assert isinstance(json.loads(got_calls[0].function.arguments), dict) and got_content is None


def test_tools_and_chat_template_options_reach_the_template(server, llama_dir):
    client = server.client()
    plain = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=1)
    # tool_choice "none": the model reads the tools (the template renders them) and answers in text.
    out = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=4, tools=[WEATHER],
                                         tool_choice="none")
    assert out.usage.prompt_tokens > plain.usage.prompt_tokens + 3 and out.choices[0].message.tool_calls is None
    # An earlier call and its answer go to the template too.
    history = MESSAGES + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    longer = client.chat.completions.create(model=NAME, messages=history, max_tokens=1)
    assert longer.usage.prompt_tokens > plain.usage.prompt_tokens + 10
    # The assistant's message continued: the prompt ends with its text, no end-of-turn after it.
    prefix = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The answer is"}]
    body = {"model": NAME, "messages": prefix, "add_generation_prompt": False, "continue_final_message": True}
    ids = httpx.post(f"{server.url}/tokenize", json=body, headers=AUTH).json()["tokens"]
    tok = load_tokenizer(llama_dir)
    assert tok.decode(ids).endswith("<|assistant|>The answer is")
    out = client.chat.completions.create(model=NAME, messages=prefix, max_tokens=3, temperature=0,
                                         extra_body={"add_generation_prompt": False, "continue_final_message": True})
    assert out.usage.prompt_tokens == len(ids)
    for extra, why in (({"continue_final_message": True}, "set add_generation_prompt to False \\(false in JSON\\)"),
                       ({"chat_template_kwargs": {"tokenize": True}}, "tokenize are the request's own fields")):
        with pytest.raises(openai.BadRequestError, match=why):
            client.chat.completions.create(model=NAME, messages=prefix, max_tokens=2, extra_body=extra)
    for kwargs, why in ((dict(tools=[WEATHER]), "needs a server started with --enable-auto-tool-choice"),
                        (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
                         "not among the tools"),
                        (dict(tools=[{"type": "function"}], tool_choice="required"), "tools\\[0\\]"),
                        (dict(tools=[WEATHER], tool_choice="sometimes"), "tool_choice: give"),
                        (dict(tool_choice="required"), "tool_choice needs tools"),
                        (dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}),
                         "give no response_format")):
        with pytest.raises(openai.BadRequestError, match=why):
            client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=2, **kwargs)
    _still_serves(server)


def test_logprobs(server, llm_pp2):
    expected = _greedy(llm_pp2, PROMPT, max_tokens=6, logprobs=3).outputs[0]
    out = server.client().completions.create(model=NAME, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == out.usage.completion_tokens
    for tid, entry, got, top in zip(expected.token_ids, expected.logprobs, lp.token_logprobs, lp.top_logprobs):
        assert got == pytest.approx(entry[tid].logprob, abs=1e-4)
        assert 1 <= len(top) <= 4 and max(top.values()) <= 0.0

    out = server.client().chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=5, temperature=0,
                                                  logprobs=True, top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for item in content:
        assert len(item.top_logprobs) == 2 and item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob)  # greedy takes the top token
    for create, kwargs in ((server.client().completions.create, dict(prompt=PROMPT, logprobs=21)),
                           (server.client().chat.completions.create,
                            dict(messages=MESSAGES, logprobs=True, top_logprobs=21))):
        with pytest.raises(openai.BadRequestError, match="logprobs=21 is over the engine's max_logprobs=20"):
            create(model=NAME, max_tokens=2, **kwargs)


def test_echo_returns_the_prompt_with_its_logprobs(server, llm_pp2):
    """As vLLM's server: the prompt's tokens first (the first with null log-probabilities), then the completion's."""
    ids = llm_pp2.get_tokenizer().encode(PROMPT)
    expected = _greedy(llm_pp2, PROMPT, max_tokens=3, logprobs=2, prompt_logprobs=2)
    for max_tokens in (0, 3):
        for stream in (False, True):
            resp = server.client().completions.create(model=NAME, prompt=PROMPT, max_tokens=max_tokens,
                                                      temperature=0, logprobs=2, echo=True, stream=stream)
            chunks = list(resp) if stream else [resp]
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            lp = {k: sum((getattr(c.choices[0].logprobs, k) for c in chunks if c.choices and c.choices[0].logprobs),
                         []) for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
            completion = expected.outputs[0] if max_tokens else None
            assert text == PROMPT + (completion.text if completion else "")
            assert len(lp["tokens"]) == len(ids) + (len(completion.token_ids) if completion else 0)
            assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
            want = [e[t].logprob for t, e in zip(ids[1:], expected.prompt_logprobs[1:])]
            if completion:
                want += [e[t].logprob for t, e in zip(completion.token_ids, completion.logprobs)]
            assert lp["token_logprobs"][1:] == pytest.approx(want, abs=1e-5)
            assert "".join(lp["tokens"]) == text and lp["text_offset"][1] == len(lp["tokens"][0])


def test_stream_events_survive_clients_that_split_lines_at_unicode_separators(server):
    """httpx's iter_lines() splits where str.splitlines() does: at U+2028, U+0085, \\x1c ... as well as at newlines.
    Text holding them (echoed here; a sampled token can hold them too) must not cut an event in two."""
    prompt = "a\u2028b\x85c\x1cd\u2029e"
    body = {"model": NAME, "prompt": prompt, "max_tokens": 2, "echo": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=60) as resp:
        lines = [line for line in resp.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]).startswith(prompt)
    err = _error(httpx.post(f"{server.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 0}, headers=AUTH),
                 400)
    assert err["param"] == "max_tokens" and "echo" in err["message"]


def test_tokenize_and_detokenize_as_vllm(server, llm_pp2):
    tokenizer = llm_pp2.get_tokenizer()
    out = httpx.post(f"{server.url}/tokenize", json={"model": NAME, "prompt": PROMPT}, headers=AUTH).json()
    assert out["tokens"] == tokenizer.encode(PROMPT) and out["count"] == len(out["tokens"])
    assert out["max_model_len"] == MAX_MODEL_LEN
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": MESSAGES}, headers=AUTH).json()
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert chat["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    back = httpx.post(f"{server.url}/detokenize", json={"tokens": out["tokens"]}, headers=AUTH).json()
    assert back == {"prompt": PROMPT}
    assert _error(httpx.post(f"{server.url}/detokenize", json={"tokens": [10 ** 6]}, headers=AUTH), 400)["param"] \
        == "tokens"
    _error(httpx.post(f"{server.url}/tokenize", json={"prompt": PROMPT}), 401)


def test_generation_config_gives_the_defaults_a_request_leaves_out(tmp_path):
    from pipellm.entrypoints.protocol import CompletionRequest, sampling_params
    from pipellm.entrypoints.server import ServerConfig
    params = sampling_params(CompletionRequest(prompt="x", top_p=0.5), 16, None,
                              defaults={"temperature": 0.6, "top_p": 0.9, "top_k": 20})
    assert (params.temperature, params.top_p, params.top_k) == (0.6, 0.5, 20)
    with pytest.raises(ValueError, match="no generation_config.json"):
        ServerConfig("m", generation_config=str(tmp_path))


# ---- errors -----------------------------------------------------------------------------------------------------

def _error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def test_error_statuses_and_still_serving(server):
    url, client = server.url, server.client()
    completions = f"{url}/v1/completions"
    assert "not valid JSON" in _error(httpx.post(completions, content=b"{bad", headers=AUTH), 400)["message"]
    assert _error(httpx.post(completions, json={"prompt": PROMPT, "n": "two"}, headers=AUTH), 400)["param"] == "n"
    _error(httpx.post(completions, json={"max_tokens": 3}, headers=AUTH), 400)  # no prompt
    _still_serves(server)
    with pytest.raises(openai.BadRequestError, match="top_p"):
        client.completions.create(model=NAME, prompt=PROMPT, top_p=0.0)
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        client.completions.create(model=NAME, prompt=PROMPT, max_tokens=MAX_MODEL_LEN)
    with pytest.raises(openai.BadRequestError, match=r"priority=3: this engine runs requests first come, first "
                                                     r"served; start the server with .*--scheduling-policy priority"):
        client.chat.completions.create(model=NAME, messages=MESSAGES, extra_body={"priority": 3})
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        client.completions.create(model=NAME, prompt="a " * 200, max_tokens=1)
    err = _error(httpx.post(completions, json={"prompt": [10 ** 6], "max_tokens": 1}, headers=AUTH), 400)
    assert "integers in [0, 384)" in err["message"] and err["param"] == "prompt"
    err = _error(httpx.post(completions, json={"prompt": "a", "logit_bias": {"500": 1}}, headers=AUTH), 400)
    assert err["param"] == "logit_bias"
    _still_serves(server)
    # values a lax reading would take as something else ("yes" as true, true as token 1), and one the stages would
    # refuse after the checks here had passed it, which ended the pipeline for every client
    for body, param in (({"stream": "yes"}, "stream"), ({"prompt": [True, 5]}, "prompt"), ({"max_tokens": 2.5},
                                                                                          "max_tokens"),
                        ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs")):
        err = _error(httpx.post(completions, json={"prompt": PROMPT, "max_tokens": 2} | body, headers=AUTH), 400)
        assert err["param"] == param and ("json_object='yes': must be True or False" in err["message"]
                                          or "Input should be a valid" in err["message"]), err
    err = _error(httpx.post(completions, json={"prompt": PROMPT, "stream_options": {"include_usage": True}},
                            headers=AUTH), 400)
    assert err["param"] == "stream_options" and "give stream=true with it" in err["message"]
    nested = b'{"prompt": "a", "logit_bias": ' + b'{"a": ' * 900 + b"1" + b"}" * 901
    assert "nests more than 64 levels" in _error(httpx.post(completions, content=nested, headers=AUTH),
                                                  400)["message"]
    _still_serves(server)
    with pytest.raises(openai.AuthenticationError):
        server.client("wrong-key").completions.create(model=NAME, prompt=PROMPT)
    assert _error(httpx.get(f"{url}/v1/models"), 401)["code"] == "invalid_api_key"
    for route in ("load_lora_adapter", "unload_lora_adapter"):  # before it says the routes are off
        assert _error(httpx.post(f"{url}/v1/{route}", json={"lora_name": "a"}), 401)["code"] == "invalid_api_key"
    _still_serves(server)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-4", messages=MESSAGES)
    _still_serves(server)
    big = b'{"prompt": "' + b"a" * (2 << 20) + b'"}'
    assert _error(httpx.post(completions, content=big, headers=AUTH), 413)["code"] == "request_too_large"
    chunked = (big[i:i + 65536] for i in range(0, len(big), 65536))  # no content-length: counted as it arrives
    _error(httpx.post(completions, content=chunked, headers=AUTH), 413)
    _still_serves(server)


def test_dead_stage_gives_503_then_sigterm_leaves_no_stage(llama_dir, tmp_path):
    with serve(llama_dir, tmp_path, "--max-model-len", "64") as dead:
        pids = dead.stage_pids()
        os.kill(pids[1], signal.SIGKILL)
        wait_until(lambda: httpx.get(f"{dead.url}/health").status_code == 503, 10, "/health to say 503")
        err = _error(httpx.post(f"{dead.url}/v1/completions", json={"prompt": PROMPT}), 503)
        assert err["code"] == "engine_dead" and f"stage 1 (pid {pids[1]}) was killed by signal 9" in err["message"]
        with pytest.raises(openai.InternalServerError):
            dead.client().chat.completions.create(model=llama_dir, messages=MESSAGES)
        assert httpx.get(f"{dead.url}/v1/models").status_code == 200  # still answering
        wait_until(lambda: not any(map(is_running, pids)), 10, "the other stage to be stopped")
        dead.proc.send_signal(signal.SIGTERM)
        dead.proc.wait(20)


# ---- load, disconnects, metrics -----------------------------------------------------------------------------------

async def _stream(client: httpx.AsyncClient, url: str, i: int, disconnect: bool) -> dict:
    body = {"model": NAME, "prompt": f"Hello world {i}", "max_tokens": 100 if disconnect else 24, "temperature": 0.8,
            "seed": i, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    events = []
    async with client.stream("POST", f"{url}/v1/completions", json=body, headers=AUTH) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if disconnect and len(events) == 3:
                    break  # leaving the block closes the connection mid-stream
    return {"events": events}


def test_32_concurrent_streams_some_disconnect_then_kv_cache_empty(server):
    before = _metrics(server)
    disconnect = [i % 4 == 0 for i in range(32)]

    async def run():
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(_stream(client, server.url, i, d) for i, d in enumerate(disconnect)))

    results = asyncio.run(run())
    for r, d in zip(results, disconnect):
        if d:
            continue
        assert r["events"][-1] == "[DONE]"
        usage = json.loads(r["events"][-2])["usage"]
        assert usage["completion_tokens"] == 24
        assert json.loads(r["events"][-3])["choices"][0]["finish_reason"] == "length"
    after, aborted = _when_all_ended(server, before)
    assert aborted == sum(disconnect)
    # The disconnected requests stopped early: fewer tokens than their 100 each.
    generated = after["pipellm:generation_tokens_total"] - before["pipellm:generation_tokens_total"]
    assert generated < 24 * 24 + 8 * 80
    _still_serves(server)


def test_a_responses_stream_whose_client_hangs_up_is_aborted(server):
    before = _metrics(server)
    body = {"input": PROMPT, "stream": True, "max_output_tokens": 80, "ignore_eos": True}
    with httpx.stream("POST", f"{server.url}/v1/responses", json=body, headers=AUTH, timeout=60) as resp:
        assert resp.status_code == 200
        events = [line for line in itertools.islice(resp.iter_lines(), 40) if line.startswith("event: ")]
    assert events[-1] == "event: response.output_text.delta"  # hung up mid-reply
    assert _when_all_ended(server, before)[1] == 1
    _still_serves(server)


def test_client_gone_before_a_plain_answer_aborts(server):
    before = _metrics(server).get("pipellm:request_finished_total[abort]", 0)
    with _posted_completion(server, {"model": NAME, "prompt": PROMPT, "max_tokens": 120, "n": 4, "ignore_eos": True}):
        wait_until(lambda: _metrics(server)["pipellm:num_requests_running"] > 0, 10, "the request to run")
    wait_until(lambda: _metrics(server).get("pipellm:request_finished_total[abort]", 0) == before + 4, 10,
                "the completions to be aborted")
    wait_until(lambda: _metrics(server)["pipellm:kv_cache_usage_perc"] == 0.0, 10, "the KV cache to empty")


def test_metrics_parse_and_move(server):
    before = _metrics(server)
    server.client().completions.create(model=NAME, prompt=PROMPT, max_tokens=4, temperature=0, extra_body={
        "ignore_eos": True})
    after = _metrics(server)
    assert after["pipellm:prompt_tokens_total"] > before["pipellm:prompt_tokens_total"]
    assert after["pipellm:generation_tokens_total"] - before["pipellm:generation_tokens_total"] == 4
    for hist in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        assert after[f"pipellm:{hist}_count"] > before[f"pipellm:{hist}_count"]
    for name in ("pipellm:kv_cache_usage_perc", "pipellm:prefix_cache_hit_rate"):
        assert name in after
    # Per-stage figures come from the engine thread every ~2 s.
    key = "pipellm:stage_busy_seconds_total[0]"
    wait_until(lambda: _metrics(server).get(key, 0) > before.get(key, 0), 10, "stage busy seconds to move")
    m = _metrics(server)
    assert m["pipellm:stage_busy_seconds_total[1]"] > 0
    assert m["pipellm:stage_activation_bytes_sent_total[0->1][0]"] > 0
    weights = [v for k, v in m.items() if k.startswith("pipellm:stage_weight_bytes[") and k.endswith("][0]")]
    assert weights and all(v > 0 for v in weights) and m["pipellm:stage_memory_bytes[kv_cache][1]"] > 0


def test_sigterm_ends_in_flight_request_and_leaves_no_stage(server):
    """Runs last: it stops the module's server."""
    pids = server.stage_pids()
    events = []

    def reader():
        body = {"model": NAME, "prompt": PROMPT, "max_tokens": 100, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=60) as resp:
            events.extend(line for line in resp.iter_lines() if line.startswith("data: "))

    thread = threading.Thread(target=reader)
    thread.start()
    wait_until(lambda: len(events) > 0, 20, "the stream to start")
    for pid in pids + [server.proc.pid]:  # to every process, as systemd or `timeout` signal a process group
        os.kill(pid, signal.SIGTERM)
    thread.join(30)
    assert not thread.is_alive() and events[-1] == "data: [DONE]"
    server.proc.wait(30)
    assert not any(map(is_running, pids)), "a stage process outlived the server"
    with open(server.log) as f:
        assert "restarting the pipeline" not in f.read()  # the stages left the stopping to the server
    # --trace-dir: the whole session's pipeline trace is written on the way out.
    trace_dir = os.path.join(os.path.dirname(server.log), "trace")
    trace = json.load(open(os.path.join(trace_dir, "trace.json")))
    forwards = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["tid"] == 0]
    assert {e["pid"] for e in forwards} == {0, 1} and len(forwards) > 50
    assert os.path.getsize(os.path.join(trace_dir, "pipeline.png")) > 0


@pytest.mark.parametrize("flags", [["--num-scheduler-steps", "6"], ["--async-scheduling"],
                                   ["--no-restart-on-failure"]])
def test_streams_of_one_stage_equal_the_engine_output(llama_dir, llm_pp2, tmp_path, flags):
    """One stage with --num-scheduler-steps (tokens reach the server in bursts), async scheduling (its default:
    a step sent before the last one's token is back) or in the server's own process (without restarts): the stream,
    the usage and the stop string's cut are what two stages give."""
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    expected = llm_pp2.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    stop = expected.text[len(expected.text) // 2:][:3]  # a stop string inside the output
    cut = llm_pp2.generate(PROMPT, SamplingParams(max_tokens=20, temperature=0.0, stop=[stop]),
                           use_tqdm=False)[0].outputs[0]
    with serve(llama_dir, tmp_path, "-pp", "1", *flags) as srv:
        if "--no-restart-on-failure" in flags:
            assert srv.stage_pids() == [srv.proc.pid]
        client = srv.client()
        model = client.models.list().data[0].id
        chunks = list(client.completions.create(model=model, prompt=PROMPT,
                                                max_tokens=20, temperature=0.0, stream=True,
                                                stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True}))
        stopped = client.completions.create(model=model, prompt=PROMPT, max_tokens=20, temperature=0.0,
                                            stop=[stop])
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    assert chunks[-1].usage.completion_tokens == 20
    assert stopped.choices[0].text == cut.text and stopped.choices[0].finish_reason == "stop"
