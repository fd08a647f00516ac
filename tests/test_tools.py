"""Tool calls: tool_choice "required" holds the output to a list of the tools' calls; the hermes parser reads a model's
own <tool_call> markup ("auto"). The server's end of it: tests/test_server.py."""
import json

import pytest

from pipellm import SamplingParams
from pipellm.entrypoints.protocol import APIError
from pipellm.entrypoints.tools import ReplyStream, check_tools, choice_of, forced_output, parse

TOOLS = check_tools([
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["city"],
        "properties": {"city": {"enum": ["Paris", "Rome"]}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["utc"],
        "properties": {"utc": {"type": "boolean"}}}}}])


def test_required_gives_calls_of_the_tools_with_their_arguments(llm_pp2):
    """One call each (parallel_tool_calls=false: a random model may list calls past max_tokens); several, parsed."""
    params = SamplingParams(n=6, max_tokens=100, temperature=1.0, seed=3,
                            structured_outputs=forced_output(TOOLS, "required", parallel=False))
    outs = llm_pp2.chat([{"role": "user", "content": "Hi"}], params, use_tqdm=False)[0].outputs
    two = '[{"name":"get_time","parameters":{"utc":true}},{"name":"get_weather","parameters":{"city":"Rome"}}]'
    for text in [o.text for o in outs] + [two]:
        content, calls = parse(text, "required")
        assert content is None and len(calls) == (2 if text == two else 1), text
        for call in calls:
            args = json.loads(call["function"]["arguments"])
            assert (call["function"]["name"], args) in [("get_weather", {"city": "Paris"}),
                                                        ("get_weather", {"city": "Rome"}),
                                                        ("get_time", {"utc": True}), ("get_time", {"utc": False})]
            assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")


def test_llm_chat_shows_the_tools_to_the_template(llm_pp2):
    hi = [{"role": "user", "content": "Hi"}]
    prompt = llm_pp2.chat_prompt(hi, tools=TOOLS)["prompt"]
    assert "<|tools|>get_weather get_time <|end|>" in prompt and prompt.endswith(llm_pp2.chat_prompt(hi)["prompt"])


def test_hermes_markup_is_parsed_and_anything_else_stays_text():
    text = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>\n'
            '<tool_call>{"name": "get_time", "arguments": {"utc": true}}</tool_call>')
    content, calls = parse(text, "auto")
    assert content == "Let me look."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Rome"}), ("get_time", {"utc": True})]
    assert len({c["id"] for c in calls}) == 2
    assert [c["function"]["name"] for c in parse(text, "auto", parallel=False)[1]] == ["get_weather"]
    for text in ("No tools needed.", '<tool_call>{"name": "get_time", "arguments": {"utc": tr',  # cut off
                 '<tool_call>{"arguments": {}}</tool_call>'):                                     # no name
        assert parse(text, "auto") == (text, [])
    assert parse('<tool_call>{"name": "x"}</tool_call>', "none")[1] == []


def _stream(text: str, choice, step: int) -> tuple[list[str], list[dict]]:
    """The content pieces and the calls a reply streamed `step` characters at a time gives."""
    reply, pieces, calls = ReplyStream(choice), [], []
    for i in range(0, len(text), step):
        content, calls = reply.add(text[i:i + step], i + step >= len(text))
        pieces.append(content)
    return pieces, calls


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_a_streamed_reply_sends_its_text_until_a_call_begins(step):
    text = 'Let me look. <tool_call>{"name": "get_time", "arguments": {"utc": true}}</tool_call>'
    pieces, calls = _stream(text, "auto", step)
    assert "".join(pieces) == "Let me look. " and [c["function"]["name"] for c in calls] == ["get_time"]
    if step == 1:  # each character as it comes, but for a tail that could begin the mark
        assert pieces[:3] == ["L", "e", "t"] and pieces[13:24] == [""] * 11
    plain = "No call: 1 < 2 and <tool is not a call."
    pieces, calls = _stream(plain, "auto", step)
    assert "".join(pieces) == plain and calls == []
    if step == 1:
        assert pieces[plain.index("<")] == "" and pieces[plain.index("<") + 1] == "< "  # held, then no mark
    broken = 'Hm <tool_call>{"name": "get_t'  # cut by max_tokens: text after all
    assert "".join(_stream(broken, "auto", step)[0]) == broken
    forced = '[{"name":"get_time","parameters":{"utc":false}}]'
    pieces, calls = _stream(forced, "required", step)
    assert "".join(pieces) == "" and json.loads(calls[0]["function"]["arguments"]) == {"utc": False}


def test_llama3_json_replies_are_calls_from_their_start():
    one = '{"name": "get_weather", "parameters": {"city": "Rome"}}'
    two = '<|python_tag|>{"name": "get_time", "arguments": {"utc": true}}; ' + one
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parse(two, "auto",
                                                                                          parser="llama3_json")[1]] \
        == [("get_time", {"utc": True}), ("get_weather", {"city": "Rome"})]
    assert parse(" " + one, "auto", parser="llama3_json")[0] is None
    for text in ("It is {not} a call.", '{"name": "get_time", "parameters": {"utc": tr', '{"parameters": {}}'):
        assert parse(text, "auto", parser="llama3_json") == (text, [])
    for step in (1, 4):
        reply, pieces = ReplyStream("auto", parser="llama3_json"), []
        for i in range(0, len(two), step):
            pieces.append(reply.add(two[i:i + step], i + step >= len(two)))
        assert "".join(p[0] for p in pieces) == "" and len(pieces[-1][1]) == 2
        reply = ReplyStream("auto", parser="llama3_json")
        assert reply.add("<|py", False) == ("", []) and reply.add("thon is fun", True) == ("<|python is fun", [])
        reply = ReplyStream("auto", parser="llama3_json")
        assert reply.add("Sure", False) == ("Sure", []) and reply.add(" {x}", True) == (" {x}", [])


@pytest.mark.parametrize("tools,choice,parser,message", [
    (TOOLS, None, None, "needs a server started with --enable-auto-tool-choice"),
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, None, "not among the tools"),
    (TOOLS, "sometimes", "hermes", "tool_choice: give"),
    (None, "required", None, "tool_choice needs tools"),
])
def test_tool_choices_this_server_cannot_follow(tools, choice, parser, message):
    with pytest.raises(APIError, match=message):
        choice_of(tools, choice, parser)


def test_tool_choices():
    assert choice_of(TOOLS, None, "hermes") == "auto" and choice_of(None, None, None) == "none"
    assert choice_of(TOOLS, {"type": "function", "function": {"name": "get_time"}}, None)["name"] == "get_time"
    assert forced_output(TOOLS, "none") is None and forced_output(TOOLS, "auto") is None
    with pytest.raises(APIError, match=r"tools\[1\]"):
        check_tools([TOOLS[0], {"type": "function", "function": {"parameters": {}}}])


def test_unknown_parsers_are_refused_with_the_known_ones():
    from pipellm.entrypoints.server import ServerConfig
    with pytest.raises(ValueError, match="--tool-call-parser mistral: give one of hermes, llama3_json"):
        ServerConfig("m", tool_call_parser="mistral")
    with pytest.raises(ValueError, match="--reasoning-parser r2: give one of qwen3, deepseek_r1"):
        ServerConfig("m", reasoning_parser="r2")


def test_harmony_parsers_go_together_and_are_a_gpt_oss_models_default():
    from pipellm.entrypoints.openai_server import for_model
    from pipellm.entrypoints.server import ServerConfig
    with pytest.raises(ValueError, match="--tool-call-parser openai, not hermes"):
        ServerConfig("m", tool_call_parser="hermes", reasoning_parser="openai_gptoss")
    with pytest.raises(ValueError, match="give --reasoning-parser openai_gptoss, not qwen3"):
        ServerConfig("m", tool_call_parser="openai", reasoning_parser="qwen3")
    with pytest.raises(ValueError, match="this model is LlamaForCausalLM: give --reasoning-parser openai_gptoss"):
        for_model(ServerConfig("m", tool_call_parser="openai"), "LlamaForCausalLM")
    for given in (dict(reasoning_parser="qwen3"), dict(tool_call_parser="hermes")):  # they would return markup
        with pytest.raises(ValueError, match=f"which {next(iter(given.values()))} cannot read: give --reasoning-"):
            for_model(ServerConfig("m", **given), "GptOssForCausalLM")
    assert for_model(ServerConfig("m"), "GptOssForCausalLM").reasoning_parser == "openai_gptoss"
    assert for_model(ServerConfig("m", tool_call_parser="openai"), "GptOssForCausalLM").reasoning_parser \
        == "openai_gptoss"
    assert for_model(ServerConfig("m"), "LlamaForCausalLM").reasoning_parser is None
    assert for_model(ServerConfig("m", reasoning_parser="openai_gptoss"), "LlamaForCausalLM").reasoning_parser \
        == "openai_gptoss"  # a model of another architecture trained on harmony
