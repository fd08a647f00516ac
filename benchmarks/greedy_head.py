"""Greedy picks from the default model's LM head (Q8_0, 49,152 x 576): the full fp32 logits and the sampler's argmax
against CompactLinear.greedy (products of rounded rows in AMX tiles, or without them in AVX512-VNNI, then fp32
products of the candidates only), in alternating rounds of one run, on real final hidden states (the last norm's
output over a prefilled text), and whether the two pick the same tokens. Needs AMX or AVX512-VNNI. --cold rewrites
256 MB between two calls, so that the head comes from memory, as in a stage whose layers' weights pass through the
caches between two heads.
`cd benchmarks && python greedy_head.py [--rows 3,8,16,32] [--threads 1] [--cold]`"""
import argparse
import json
import os
import time

import torch
from tokenizers import Tokenizer

from decode_step import BLOCK, default_model_stage, random_caches
from pipellm.loader.default_model import default_model_path
from pipellm.loader.gguf import cached_gguf_folder
from pipellm.models.attention import AttentionMetadata
from pipellm.sampler import greedy_ids

TEXT = os.path.join(os.path.dirname(__file__), "..", "README.md")


def final_rows(cfg, model, tokens: int = 512) -> torch.Tensor:
    """The final norm's output at each position of the README's first tokens: [tokens, hidden]."""
    tok = Tokenizer.from_file(os.path.join(cached_gguf_folder(default_model_path()), "tokenizer.json"))
    ids = torch.tensor(tok.encode(open(TEXT).read()).ids[:tokens])
    n = len(ids)
    blocks = n // BLOCK + 1
    caches = random_caches(cfg, blocks, torch.Generator().manual_seed(0))
    pos = torch.arange(n)
    meta = AttentionMetadata.for_layers([False] * cfg.num_layers, None, pos, torch.tensor([n]), torch.tensor([n]),
                                        torch.arange(blocks, dtype=torch.int32)[None], pos, BLOCK)
    return model.norm(model(ids, pos, meta, caches)).contiguous()


def best_ms(fn, x, rounds: int, evict: torch.Tensor | None = None) -> float:
    fn(x)
    times = []
    for _ in range(rounds):
        if evict is not None:
            evict.add_(1.0)
        start = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="3,8,16,32")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--cold", action="store_true", help="the head read from memory: 256 MB rewritten between calls")
    args = parser.parse_args()
    evict = torch.ones(64 * 2**20) if args.cold else None
    torch.set_num_threads(args.threads)
    cfg, model = default_model_stage()
    head = model.lm_head
    with torch.inference_mode():
        xs = final_rows(cfg, model)
        full = lambda x: greedy_ids(head(x))  # noqa: E731
        if head.greedy(xs[:16]) is None:
            raise SystemExit("greedy_head.py: CompactLinear.greedy does not apply here (it needs AMX or AVX512-VNNI)")
        same = all(torch.equal(head.greedy(xs[s:s + n]), full(xs[s:s + n]))  # AMX: int8 tiles to 16 rows, bf16 past
                   for n in (16, 32) for s in range(0, len(xs) - n + 1, n))
        result = {"threads": args.threads, "cold": args.cold, "same_picks_on_all_rows": same, "rows": {}}
        for rows in map(int, args.rows.split(",")):
            x = xs[:rows]
            t_full, t_greedy = [], []
            for _ in range(3):  # alternating
                t_full.append(best_ms(full, x, args.rounds, evict))
                t_greedy.append(best_ms(head.greedy, x, args.rounds, evict))
            result["rows"][rows] = {"full_ms": min(t_full), "greedy_ms": min(t_greedy),
                                    "speedup": min(t_full) / min(t_greedy)}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
