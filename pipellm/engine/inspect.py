"""LLM.inspect on the driver: one prompt through the pipeline as probe batches, then one generated token fed back,
and what every layer did with them, as plain data (what pipellm inspect draws and saves as inspect.json)."""
import dataclasses
import itertools

import numpy as np

from pipellm.engine.engine import LLMEngine
from pipellm.pipeline.messages import ProbeReport
from pipellm.sampling_params import SamplingParams

_ids = itertools.count()


def run_probe(engine: LLMEngine, prompt_token_ids: list[int]) -> dict:
    """The prompt's prefill and one decode step, every batch a probe; returns inspect.json's data."""
    if engine.model_config.keeps_states:
        raise ValueError(f"inspect shows each layer's attention over its KV cache; {engine.model_config.architecture}"
                         "'s linear-attention (or Mamba) layers hold a state, and it does not run them")
    if engine.has_unfinished_requests() or engine.in_flight:
        raise ValueError("inspect needs the engine to itself; call it between generate calls, not while "
                         "requests run")
    # greedy: the token the lens explains is the one the model ranks first; two steps: the second feeds it back
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    engine.inputs.validate(prompt_token_ids, params)
    if len(prompt_token_ids) + 1 >= engine.max_model_len:
        raise ValueError(f"inspect feeds the next token back, so the prompt must be shorter than max_model_len - 1 "
                         f"= {engine.max_model_len - 1} tokens; shorten it")
    rid = f"inspect-{next(_ids)}"
    engine.add_request(rid, prompt_token_ids, params)
    req = engine.requests[rid]
    req.use_prefix_cache = False  # a cached prefix would skip the very layers' outputs inspect shows
    num_prompt, num_layers = len(prompt_token_ids), engine.model_config.num_layers
    lens_ids = np.zeros((num_layers, num_prompt), np.int64)
    lens_probs = np.zeros((num_layers, num_prompt), np.float32)
    next_probs = None
    try:
        while not req.is_finished:
            batch = engine.scheduler.schedule()
            assert batch is not None and batch.requests == [req], "the probe request runs alone"
            stage_batch = dataclasses.replace(batch.stage_batch, probe=True)
            engine.executor.submit(stage_batch)
            engine.in_flight.append(batch)
            result = engine.executor.receive()
            reports = engine.executor.receive_probes(stage_batch)
            engine.process_result(engine.in_flight.popleft(), result)
            last = reports[-1]
            prompt_rows = stage_batch.positions < num_prompt  # columns of the lens: prompt positions only
            lens_ids[:, stage_batch.positions[prompt_rows]] = last.lens_ids[:, prompt_rows]
            lens_probs[:, stage_batch.positions[prompt_rows]] = last.lens_probs[:, prompt_rows]
            if len(req.output_token_ids) == 1 and next_probs is None:  # the step that chose the next token
                next_probs = last.sampled_probs[:, 0]
    except BaseException:
        engine.abort_request(rid)
        raise
    output = engine.pop_output(rid, None)
    return _to_data(engine, prompt_token_ids, output.outputs[0].token_ids[0], lens_ids, lens_probs, next_probs,
                    reports)


def _to_data(engine: LLMEngine, prompt_ids: list[int], next_id: int, lens_ids: np.ndarray, lens_probs: np.ndarray,
             next_probs: np.ndarray, reports: list[ProbeReport]) -> dict:
    """inspect.json's shape. The decode step's reports hold the attention of the generated token."""
    decode = engine.tokenizer.decode if engine.tokenizer is not None else (lambda ids: f"<{ids[0]}>")
    vocab = {t: decode([t]) for t in set(lens_ids.flatten().tolist()) | set(prompt_ids) | {next_id}}
    layers = []
    for stage, report in zip(engine.stages, reports):
        for i in range(stage.num_layers):
            layer = stage.start + i
            layers.append({
                "layer": layer, "stage": stage.rank,
                "top_tokens": [vocab[t] for t in lens_ids[layer].tolist()],
                "top_token_ids": lens_ids[layer].tolist(),
                "top_probs": [round(p, 6) for p in lens_probs[layer].tolist()],
                "next_token_prob": round(float(next_probs[layer]), 6),
                "attention": [[round(p, 6) for p in head] for head in report.attention[i].tolist()],
                "kv_blocks": report.kv_blocks[i],
                "kv_key_rms": [round(r, 6) for r in report.kv_key_rms[i]],
            })
    return {
        "model": engine.config.model or "default",
        "prompt_tokens": [vocab[t] for t in prompt_ids], "prompt_token_ids": list(prompt_ids),
        "next_token": vocab[next_id], "next_token_id": next_id,
        # the columns of each layer's attention: the prompt, then the generated token fed back
        "cached_tokens": [vocab[t] for t in prompt_ids] + [vocab[next_id]],
        "block_size": engine.config.block_size,
        "stages": [{"stage": s.rank, "first_layer": s.start, "last_layer": s.end - 1} for s in engine.stages],
        "layers": layers,
    }
