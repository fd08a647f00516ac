"""Prefix-cache hits of a burst of prompts that share a system prompt, at PP=2, per token budget of a batch:
tests/test_prefix_cache.py's 23 prompts on a tiny random Llama (BENCHMARKS.md, "Prefix-cache hits across batches
in flight"). Prints one line a budget: hits, tokens looked up, seconds.
    .venv/bin/python benchmarks/prefix_hits.py"""
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tests.*

from pipellm import LLM  # noqa: E402
from tests.conftest import FP32, make_checkpoint  # noqa: E402
from tests.test_prefix_cache import GREEDY, _prompts  # noqa: E402

with tempfile.TemporaryDirectory() as folder:
    make_checkpoint("llama", folder)
    for budget in (32, 64, 128):
        with LLM(folder, pipeline_parallel_size=2, max_num_batched_tokens=budget, dtype=FP32) as llm:
            start = time.perf_counter()
            llm.generate(_prompts(), GREEDY, use_tqdm=False)
            bm = llm.engine.block_manager
            print(f"{budget} tokens a batch: {bm.num_prefix_hits} hits of {bm.num_prefix_queries} tokens looked up "
                  f"({time.perf_counter() - start:.2f} s)", flush=True)
