"""Structured outputs: a request's tokens held to a JSON schema, a regex, a list of choices or a grammar, as vLLM's.
llguidance compiles the grammar and, each step, gives the tokens that may come next; the last stage's sampler masks
the rest of the logits. The driver compiles each request's grammar once too, to refuse a bad one before it runs."""
import json
import logging

import numpy as np
import torch

from pipellm.sampling_params import StructuredOutputsParams

log = logging.getLogger(__name__)


def _llguidance():
    try:
        import llguidance
        import llguidance.hf
    except ImportError:
        raise ValueError("structured outputs need the llguidance package: pip install 'llguidance>=1.0,<2'") from None
    return llguidance


def ll_tokenizer(hf_tokenizer, vocab_size: int, model_dir: str):
    """llguidance's view of the model's tokenizer (~0.5 s to build): token bytes for vocab_size ids, the logits'
    width."""
    if hf_tokenizer is None:
        raise ValueError(f"structured outputs need a tokenizer, and the model at {model_dir} has none")
    llg = _llguidance()
    try:
        return llg.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size)
    except Exception as e:  # a slow (Python) tokenizer, or one whose tokens llguidance cannot read
        raise ValueError(f"structured outputs: llguidance cannot read this model's tokenizer "
                         f"({type(hf_tokenizer).__name__}): {e}") from None


def ll_tokenizer_of_folder(model_dir: str, vocab_size: int):
    """The same, from the model folder's tokenizer: what the last stage builds on its first structured request."""
    from pipellm.loader.model_folder import load_tokenizer

    log.info("building the tokenizer's token table for structured outputs")
    return ll_tokenizer(load_tokenizer(model_dir), vocab_size, model_dir)


def grammar(params: StructuredOutputsParams, tokenizer) -> str:
    """params as one llguidance grammar, checked against the tokenizer; ValueError naming what is wrong."""
    llg = _llguidance()
    kind, value = params.kind
    try:
        if kind == "json" or kind == "json_object":
            # compact JSON, no whitespace between its tokens: with free whitespace a model can pad forever
            text = llg.LLMatcher.grammar_from_json_schema(value, defaults={"whitespace_flexible": False})
        elif kind == "choice":  # one terminal: a lexeme to the parser, not an alternative each (it holds 2,000)
            text = llg.grammar_from("lark", "start: CHOICE\nCHOICE: " + " | ".join(json.dumps(c)
                                                                                    for c in json.loads(value)))
        else:
            text = llg.grammar_from(kind, value)
        error = llg.LLMatcher.validate_grammar(text, tokenizer)
    except Exception as e:  # the GBNF converter and the schema parser raise; the grammar checks return a message
        error = str(e)
    if error:  # on one line: llguidance's messages point at the place with lines of their own
        raise ValueError(f"SamplingParams.structured_outputs.{kind}: "
                         + "; ".join(line.strip() for line in error.splitlines() if line.strip()))
    return text


class Matcher:
    """One request's place in its grammar."""

    def __init__(self, tokenizer, params: StructuredOutputsParams):
        self.m = _llguidance().LLMatcher(tokenizer, grammar(params, tokenizer), log_level=0)  # we log its errors

    def allowed(self, width: int) -> torch.Tensor:
        """[width] bool: the tokens that may come next (only EOS once the grammar is complete)."""
        bits = np.unpackbits(np.frombuffer(self.m.compute_bitmask(), dtype=np.uint8), bitorder="little")
        return torch.from_numpy(np.pad(bits[:width], (0, max(0, width - len(bits)))).astype(bool))

    def consume(self, token: int) -> None:
        if not self.m.consume_token(token):  # a token the mask allowed always passes; after an error only EOS does
            log.warning("structured output: %s", self.m.get_error())
