"""Reasoning parsers: a thinking model's thought split from its answer, whole and as a stream. The server's end of it:
tests/test_server.py."""
import pytest

from pipellm.entrypoints.reasoning import ReasoningStream, split

CASES = [  # text, parser, (reasoning, content)
    ("<think>\nLet me see.\n</think>\n\nParis.", "qwen3", ("\nLet me see.\n", "Paris.")),
    ("Paris.", "qwen3", (None, "Paris.")),                      # thinking off
    ("  <think>a</think>b", "qwen3", ("a", "b")),
    ("<think>cut off by max_tokens", "qwen3", ("cut off by max_tokens", "")),
    ("a < b </thin> still</think>\n\nyes", "deepseek_r1", ("a < b </thin> still", "yes")),  # the tag opened in the prompt
    ("<think>x</think>y", "deepseek_r1", ("x", "y")),
    ("all thought", "deepseek_r1", ("all thought", "")),
    ("<thinking is not the tag", "qwen3", (None, "<thinking is not the tag")),
]


@pytest.mark.parametrize("text,parser,expected", CASES)
def test_split(text, parser, expected):
    assert split(text, parser) == expected


@pytest.mark.parametrize("step", [1, 2, 5, 100])
@pytest.mark.parametrize("text,parser,expected", CASES)
def test_a_stream_gives_the_same_split(text, parser, expected, step):
    stream, thought, answer = ReasoningStream(parser), [], []
    for i in range(0, len(text), step):
        reasoning, content = stream.add(text[i:i + step], i + step >= len(text))
        thought.append(reasoning)
        answer.append(content)
        assert "<think>" not in reasoning + content and "</think>" not in reasoning + content
    assert ("".join(thought) or None, "".join(answer)) == (expected[0] or None, expected[1])
    if step == 1 and expected[0] == "\nLet me see.\n":  # pieces go out as they come, not at the end
        assert thought.index("L") < len(text) // 2
