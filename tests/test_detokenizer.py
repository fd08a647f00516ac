"""The incremental detokenizer against the tokenizer's own decode of the whole output: on real tokenizers (byte-level
BPE, SentencePiece), token by token, the text never takes anything back and ends equal to it. And the server's
streamed text: what may still change is held back."""
import random

import pytest

from pipellm.engine.detokenizer import IncrementalDetokenizer, StreamText
from pipellm.loader.model_folder import load_tokenizer

TEXT = ("Paris, la capitale de la France — « 巴黎 » 🇫🇷 naïve café; tabs\tand  double spaces,\nnew lines, "
        "<b>tags</b>, numbers 3.14159 and emoji 👩‍👩‍👧 end.")


class _ByteTokenizer:
    """Token id = one byte: makes incomplete UTF-8 sequences easy to produce."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def _tokenizer(name: str, smollm2_dir: str):
    if name == "default model (byte-level BPE)":
        return load_tokenizer(smollm2_dir)
    from pipellm.loader.default_model import named_model_path
    from pipellm.loader.gguf import cached_gguf_folder
    return load_tokenizer(cached_gguf_folder(named_model_path("gemma-3-270m")))


@pytest.mark.parametrize("name", ["default model (byte-level BPE)", "Gemma 3 (SentencePiece, byte fallback)"])
def test_equals_the_whole_decode_token_by_token(name, smollm2_dir):
    tokenizer = _tokenizer(name, smollm2_dir)
    rng = random.Random(0)
    special = list(tokenizer.all_special_ids)
    sequences = [tokenizer(TEXT, add_special_tokens=False).input_ids]
    vocab = len(tokenizer)
    sequences += [[rng.randrange(vocab) for _ in range(60)] for _ in range(20)]  # any tokens at all
    sequences += [rng.sample(special, min(2, len(special))) + sequences[0][:20]]
    for ids in sequences:
        for skip in (True, False):
            detok = IncrementalDetokenizer(tokenizer, skip)
            for i, token in enumerate(ids):
                detok.update([token], final=i == len(ids) - 1)
                whole = tokenizer.decode(ids[:i + 1], skip_special_tokens=skip)
                assert whole.startswith(detok.text), (ids[:i + 1], detok.text, whole)
            assert detok.text == tokenizer.decode(ids, skip_special_tokens=skip)


def test_waits_for_a_character_to_complete():
    detok = IncrementalDetokenizer(_ByteTokenizer())
    assert [detok.update(list(b)) for b in (b"a", b"\xc3", b"\xa9", b"\xe2\x82", b"\xac")] == ["a", "", "é", "", "€"]
    assert detok.update([0xc3], final=True) == "\ufffd"  # ends mid-character: as the whole decode does


def test_stream_holds_back_what_could_become_a_stop_string():
    stream = StreamText(["XYZ"])
    assert [stream.add(t, False) for t in ("a", "é", "X", "Y", "Q", "X")] == ["a", "é", "", "", "XYQ", ""]
    assert stream.add("YZ", True, stop_text="aéXYQ") == ""  # the engine cut at the stop string
    assert StreamText([]).add("abc", False) == "abc"
