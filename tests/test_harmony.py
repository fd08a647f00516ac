"""GPT-OSS's harmony replies read as vLLM's openai_gptoss reasoning parser and openai tool-call parser read them:
whole and as a stream. The expected splits follow the harmony format's published examples. The server's end of it:
tests/test_server.py (test_gpt_oss_harmony_replies)."""
import json

import pytest

from pipellm.entrypoints.harmony import MARKERS, HarmonyStream, split

THINK = "<|channel|>analysis<|message|>The user wants Rome's weather.<|end|>"
CALL = ('<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>'
        '{"city": "Rome"}<|call|>')
WEATHER = ("get_weather", {"city": "Rome"})
CASES = [  # reply, calls wanted, (reasoning, content, [(name, arguments)])
    (THINK + "<|start|>assistant<|channel|>final<|message|>It is noon.<|return|>", True,
     ("The user wants Rome's weather.", "It is noon.", [])),
    (THINK + CALL, True, ("The user wants Rome's weather.", "", [WEATHER])),
    (THINK + CALL, False, ("The user wants Rome's weather.", "", [])),  # tool_choice none: no call
    # the recipient in the channel part of the header, and no analysis
    ('<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Rome"}<|call|>', True,
     (None, "", [WEATHER])),
    # a preamble to the user on commentary, then a call
    ("<|channel|>commentary<|message|>Looking it up.<|end|>" + CALL, True, (None, "Looking it up.", [WEATHER])),
    # a built-in tool's call is the model's own work: reasoning
    ('<|channel|>analysis to=browser.search<|message|>{"query": "Rome"}<|call|>', True,
     ('{"query": "Rome"}', "", [])),
    ("<|channel|>analysis<|message|>One.<|end|><|start|>assistant<|channel|>analysis<|message|>Two.<|end|>"
     "<|start|>assistant<|channel|>final<|message|>Three.<|return|>", True, ("One.\nTwo.", "Three.", [])),
    ("<|channel|>analysis<|message|>cut off by max_tokens", True, ("cut off by max_tokens", "", [])),
    ('<|channel|>final<|message|>a < b and <|x|> is text<|return|>', True, (None, "a < b and <|x|> is text", [])),
    ('[{"name": "get_weather", "parameters": {}}]', True, (None, '[{"name": "get_weather", "parameters": {}}]', [])),
    # as the server reads them: without the token that ended the reply (<|call|>, <|return|>)
    (THINK + CALL.removesuffix("<|call|>"), True, ("The user wants Rome's weather.", "", [WEATHER])),
    ("<|channel|>final<|message|>It is noon.", True, (None, "It is noon.", [])),
    # the first message's recipient in its role part, right after the prompt's <|start|>assistant
    (' to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>{"city": "Rome"}', True,
     (None, "", [WEATHER])),
    ('{"city": "Rome"}', True, (None, '{"city": "Rome"}', [])),  # held to a named function's JSON
]


def _calls(calls: list[dict]) -> list[tuple]:
    out = []
    for c in calls:
        assert c["type"] == "function" and c["id"].startswith("chatcmpl-tool-")
        try:
            out.append((c["function"]["name"], json.loads(c["function"]["arguments"])))
        except ValueError:
            out.append((c["function"]["name"], c["function"]["arguments"]))
    return out


@pytest.mark.parametrize("text,want_calls,expected", CASES)
def test_split(text, want_calls, expected):
    reasoning, content, calls = split(text, want_calls)
    assert (reasoning, content, _calls(calls)) == expected


def test_a_call_cut_off_by_max_tokens_stays_text():
    text = THINK + '<|start|>assistant to=functions.get_weather<|channel|>commentary<|message|>{"city": "Ro'
    assert split(text, True, finish_reason="length") == ("The user wants Rome's weather.", '{"city": "Ro', [])
    assert _calls(split(text, True)[2]) == [("get_weather", '{"city": "Ro')]  # ended by <|call|>: as written


def test_one_call_unless_parallel():
    text = THINK + CALL + CALL.replace("Rome", "Oslo")
    assert _calls(split(text, True)[2]) == [WEATHER, ("get_weather", {"city": "Oslo"})]
    assert _calls(split(text, True, parallel=False)[2]) == [WEATHER]


@pytest.mark.parametrize("step", [1, 2, 7, 1000])
@pytest.mark.parametrize("text,want_calls,expected", CASES)
def test_a_stream_gives_the_same_split(text, want_calls, expected, step):
    stream, thought, answer, calls = HarmonyStream(want_calls), [], [], []
    for i in range(0, len(text), step):
        finished = i + step >= len(text)
        reasoning, content, got = stream.add(text[i:i + step], "stop" if finished else None)
        assert not any(m in reasoning + content for m in MARKERS)
        assert not got or finished  # the calls come whole, at the end
        thought.append(reasoning)
        answer.append(content)
        calls += got
    assert ("".join(thought) or None, "".join(answer), _calls(calls)) == expected
    if step == 1 and expected[0] == "The user wants Rome's weather.":  # the thought goes out as it comes
        assert thought.index("T") < len(THINK)
