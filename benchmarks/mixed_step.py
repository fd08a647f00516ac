"""A whole step of the default model in one process (PP=1, every layer and the LM head, no engine around it): a
512-token prefill chunk and 15 decodes at 256-token contexts together, against the chunk alone plus the decodes alone
(which take the one-call decode step), in alternating rounds. The hot-path issue's target: together <= 1.1x.
    python benchmarks/mixed_step.py [--threads 2] [--rounds 5] [--json out.json]"""
import argparse
import json
import statistics
import time

import torch
from decode_step import BLOCK, default_model_stage, random_caches

from pipellm.model_config import ModelConfig
from pipellm.models.attention import AttentionMetadata

CHUNK, DECODES, CONTEXT = 512, 15, 256


def step_inputs(cfg: ModelConfig, chunk: bool, decodes: bool, tables: torch.Tensor, gen: torch.Generator):
    """(ids, positions, meta, rows whose logits are sampled): sequence 0 is the chunk (a prompt's first 512 tokens),
    sequences 1-15 each decode their 256th token."""
    seqs = ([0] if chunk else []) + (list(range(1, DECODES + 1)) if decodes else [])
    qlens = torch.tensor([CHUNK if s == 0 else 1 for s in seqs])
    slens = torch.tensor([CHUNK if s == 0 else CONTEXT for s in seqs])
    positions = torch.cat([torch.arange(CHUNK) if s == 0 else torch.tensor([CONTEXT - 1]) for s in seqs])
    seq_of = torch.repeat_interleave(torch.tensor(seqs), qlens)
    rows = tables[seqs]
    slots = tables[seq_of, positions // BLOCK].long() * BLOCK + positions % BLOCK
    meta = AttentionMetadata.for_layers([False] * cfg.num_layers, None, positions, qlens, slens, rows, slots, BLOCK)
    ids = torch.randint(0, cfg.vocab_size, (len(positions),), generator=gen)
    return ids, positions, meta, torch.cumsum(qlens, 0) - 1


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cfg, model = default_model_stage()
    width = CHUNK // BLOCK
    gen = torch.Generator().manual_seed(0)
    tables = torch.randperm((DECODES + 1) * width, generator=gen).int().view(DECODES + 1, width)
    caches = random_caches(cfg, (DECODES + 1) * width, gen)
    kinds = {"together": (True, True), "chunk": (True, False), "decodes": (False, True)}
    inputs = {kind: step_inputs(cfg, *flags, tables, gen) for kind, flags in kinds.items()}
    times = {kind: [] for kind in kinds}
    with torch.inference_mode():
        for _ in range(args.rounds):
            for kind, (ids, positions, meta, rows) in inputs.items():
                model.compute_logits(model(ids, positions, meta, caches)[rows])  # warm-up
                for _ in range(args.steps):
                    start = time.perf_counter()
                    model.compute_logits(model(ids, positions, meta, caches)[rows])
                    times[kind].append(time.perf_counter() - start)
    ms = {kind: statistics.median(t) * 1e3 for kind, t in times.items()}
    def round_ms(kind, r):
        return statistics.median(times[kind][r * args.steps:(r + 1) * args.steps])
    ratios = [round_ms("together", r) / (round_ms("chunk", r) + round_ms("decodes", r)) for r in range(args.rounds)]
    result = {"median_ms": ms, "ratio": ms["together"] / (ms["chunk"] + ms["decodes"]), "threads": args.threads,
              "ratio_per_round": ratios}
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
