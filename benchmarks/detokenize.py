"""The text of one growing output, read after every token (what a request with stop strings, or a streamed one, needs),
with the default model's tokenizer: the whole output decoded each time (before) against the incremental
detokenizer, in one run.

    python benchmarks/detokenize.py [--tokens 256 1024 4096]
"""
import argparse
import os
import time

from pipellm.engine.detokenizer import IncrementalDetokenizer
from pipellm.loader.model_folder import load_tokenizer
from pipellm.loader.default_model import default_model_path
from pipellm.loader.gguf import cached_gguf_folder

TEXT = os.path.join(os.path.dirname(__file__), "..", "tests", "data", "perplexity.txt")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 1024, 4096])
    args = parser.parse_args()
    tokenizer = load_tokenizer(cached_gguf_folder(default_model_path()))
    with open(TEXT) as f:
        story = tokenizer(f.read(), add_special_tokens=False).input_ids
    for n in args.tokens:
        ids = (story * (n // len(story) + 1))[:n]
        start = time.perf_counter()
        for i in range(1, n + 1):
            whole = tokenizer.decode(ids[:i], skip_special_tokens=True)
        whole_s = time.perf_counter() - start
        start = time.perf_counter()
        detok = IncrementalDetokenizer(tokenizer)
        for token in ids:
            detok.update([token])
        incremental_s = time.perf_counter() - start
        assert detok.text == whole
        print(f"{n} tokens: whole decode each token {whole_s * 1e3:.0f} ms, incremental {incremental_s * 1e3:.0f} ms "
              f"({whole_s / incremental_s:.1f}x); per token {incremental_s / n * 1e6:.0f} us", flush=True)


if __name__ == "__main__":
    main()
