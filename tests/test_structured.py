"""Structured outputs: every completion holds to its JSON schema, regex, choices or grammar, greedy or drawn, over a
pipeline of two stages; bad grammars are refused before they run. The tiny random model left alone writes none of
these shapes."""
import json
import re

import pytest
import torch

from pipellm import LLM, SamplingParams, StructuredOutputsParams
from pipellm.loader.model_folder import load_tokenizer
from pipellm.sampler import Sampler
from pipellm.structured import ll_tokenizer
from tests.conftest import FP32, VOCAB

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "n", "colour"],
          "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 999},
                         "colour": {"enum": ["red", "green", "blue"]}}}


def _follows_schema(text: str) -> bool:
    obj = json.loads(text)
    return (set(obj) == {"ok", "n", "colour"} and type(obj["ok"]) is bool and type(obj["n"]) is int
            and 0 <= obj["n"] <= 999 and obj["colour"] in ("red", "green", "blue"))


CASES = [
    (StructuredOutputsParams(json=SCHEMA), _follows_schema),
    (StructuredOutputsParams(regex=r"[0-9]{3}-[a-c]{2}"), lambda text: re.fullmatch(r"[0-9]{3}-[a-c]{2}", text)),
    (StructuredOutputsParams(choice=["Paris", "the capital", "1 2 3"]), lambda text: text in ("Paris", "the capital",
                                                                                             "1 2 3")),
    (StructuredOutputsParams(grammar='root ::= ("yes" | "no") ("!" | "?")'),  # GBNF, as llama.cpp's
     lambda text: re.fullmatch(r"(yes|no)[!?]", text)),
    # past the 2,000 alternatives llguidance's parser holds at a place; and quotes, backslashes, newlines
    (StructuredOutputsParams(choice=[f"w{i}" for i in range(2500)] + ['say "hi"', "a\\b\n"]),
     lambda text: text in [f"w{i}" for i in range(2500)] + ['say "hi"', "a\\b\n"]),
]


@pytest.mark.parametrize("spec,holds", CASES, ids=[c[0].kind[0] for c in CASES])
def test_completions_hold_to_their_grammar(llm_pp2, spec, holds):
    prompts = ["The capital of France is", "Once upon a time", "def add(a, b):"]
    greedy = SamplingParams(max_tokens=48, temperature=0.0, structured_outputs=spec)
    drawn = SamplingParams(n=3, max_tokens=48, temperature=1.0, seed=5, structured_outputs=spec)
    outs = [c for o in llm_pp2.generate(prompts, greedy, use_tqdm=False) + llm_pp2.generate(prompts, drawn,
                                                                                             use_tqdm=False)
            for c in o.outputs]
    assert len(outs) == 12
    for c in outs:
        assert c.finish_reason == "stop", c.text  # the grammar was complete, then EOS
        assert holds(c.text), c.text
    free = llm_pp2.generate(prompts, SamplingParams(max_tokens=48, temperature=0.0), use_tqdm=False)
    assert not any(_holds_quietly(holds, o.outputs[0].text) for o in free)  # the model alone writes none of them


def _holds_quietly(holds, text: str) -> bool:
    try:
        return bool(holds(text))
    except ValueError:  # not JSON
        return False


def test_json_of_the_default_model(smollm2_dir):
    """A schema whose every output is short: each completion, greedy or drawn hot, ends and parses to it. Any JSON
    object: the real model closes it (a random one writes strings without end)."""
    short = {"type": "string", "maxLength": 24}
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "country", "population"],
              "properties": {"name": short, "country": short,
                             "population": {"type": "integer", "minimum": 0, "maximum": 10 ** 10}}}
    spec = StructuredOutputsParams(json=schema)
    ask = [{"role": "user", "content": "Describe Paris (name, country, population) as a JSON object."}]
    with LLM(smollm2_dir, pipeline_parallel_size=2) as llm:
        outs = [c for p in (SamplingParams(max_tokens=96, temperature=0.0, structured_outputs=spec),
                            SamplingParams(n=4, max_tokens=96, temperature=1.5, seed=1, structured_outputs=spec))
                for c in llm.chat(ask, p, use_tqdm=False)[0].outputs]
        any_object = llm.chat(ask, SamplingParams(max_tokens=96, temperature=0.0, repetition_penalty=1.1,
                                                  structured_outputs=StructuredOutputsParams(json_object=True)),
                              use_tqdm=False)[0].outputs[0]
        free = llm.chat(ask, SamplingParams(max_tokens=96, temperature=0.0), use_tqdm=False)[0].outputs[0].text
    for c in outs:
        obj = json.loads(c.text)
        assert c.finish_reason == "stop" and set(obj) == {"name", "country", "population"}, c.text
        assert len(obj["name"]) <= 24 and len(obj["country"]) <= 24 and 0 <= obj["population"] <= 10 ** 10
    assert any_object.finish_reason == "stop" and isinstance(json.loads(any_object.text), dict)
    assert not free.startswith("{")


def test_one_stage_and_mixed_batches(llama_dir, llm_pp2):
    """One stage (the sampler in the driver's process) gives the same greedy output, and a constrained request
    leaves its unconstrained batch mates as they were."""
    spec = StructuredOutputsParams(regex=r"[a-z]+ [0-9]+")
    constrained = SamplingParams(max_tokens=24, temperature=0.0, structured_outputs=spec)
    free = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    with LLM(llama_dir, dtype=FP32) as llm:
        one = llm.generate("Hello", constrained, use_tqdm=False)[0].outputs[0].text
    assert re.fullmatch(r"[a-z]+ [0-9]+", one)
    alone = llm_pp2.generate("Once upon", free, use_tqdm=False)[0].outputs[0].token_ids
    mixed = llm_pp2.generate(["Hello", "Once upon"], [constrained, free], use_tqdm=False)
    assert mixed[0].outputs[0].text == one and mixed[1].outputs[0].token_ids == alone


def test_a_restarted_request_resumes_its_grammar(llama_dir):
    """The last stage rebuilds a request's place in its grammar from the tokens it had generated before a restart."""
    tok = load_tokenizer(llama_dir)
    sampler = Sampler(lambda: ll_tokenizer(tok, VOCAB, llama_dir))
    spec = StructuredOutputsParams(choice=["Once upon a time", "Hello world"])
    before = tok.encode("Once")
    sampler.add_request("r", SamplingParams(temperature=1.0, structured_outputs=spec), [1, 2], 0, before)
    gen = torch.Generator().manual_seed(0)
    after = []
    while not after or after[-1] != tok.eos_token_id:
        assert len(after) < 20
        after.append(sampler.sample(torch.randn(1, VOCAB, generator=gen), ["r"])[0].token_id)
    assert tok.decode(before + after[:-1]) == "Once upon a time"


@pytest.mark.parametrize("kwargs,message", [
    (dict(regex="a(b"), r"(?s)structured_outputs\.regex: .*unclosed group"),
    (dict(json={"type": "wat"}), r"(?s)structured_outputs\.json: .*wat"),
    (dict(grammar='root ::= "yes'), r"structured_outputs\.grammar: "),
])
def test_bad_grammars_are_refused_before_they_run(llm_pp2, kwargs, message):
    params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(**kwargs))
    with pytest.raises(ValueError, match=message):
        llm_pp2.generate("Hello", params, use_tqdm=False)
    assert not llm_pp2.engine.has_unfinished_requests()
    assert llm_pp2.generate("Hello", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


def test_prompts_that_share_a_grammar_compile_it_once_in_the_driver(llm_pp2, monkeypatch):
    import pipellm.engine.input_processor as input_module
    calls = []
    compile_ = input_module.structured.grammar
    monkeypatch.setattr(input_module.structured, "grammar", lambda *a: calls.append(a) or compile_(*a))
    spec = StructuredOutputsParams(regex=r"[a-z]{3}[0-9]")
    outs = llm_pp2.generate(["a", "b", "c"], SamplingParams(max_tokens=8, structured_outputs=spec), use_tqdm=False)
    assert len(calls) == 1 and all(re.fullmatch(r"[a-z]{3}[0-9]", o.outputs[0].text) for o in outs)


@pytest.mark.parametrize("make,message", [
    (lambda: StructuredOutputsParams(), "give exactly one of"),
    (lambda: StructuredOutputsParams(regex="a", choice=["b"]), r"exactly one of .*\(got regex, choice\)"),
    (lambda: StructuredOutputsParams(choice=[]), "choice: must be a list of non-empty strings"),
    (lambda: StructuredOutputsParams(regex=5), "regex: must be a string"),
    (lambda: SamplingParams(min_tokens=2, structured_outputs=StructuredOutputsParams(regex="a+")), "min_tokens"),
    (lambda: SamplingParams(structured_outputs={"regex": "a"}), "must be a StructuredOutputsParams"),
])
def test_bad_structured_outputs_params_say_what_to_change(make, message):
    with pytest.raises(ValueError, match=message):
        make()
