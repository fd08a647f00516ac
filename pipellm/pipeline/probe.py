"""What a stage records in a probe batch (LLM.inspect): every layer's output, and the decode token's attention
weights. Off the hot path: a batch that is not a probe never reaches this file."""
import numpy as np
import torch
from torch import nn

from pipellm.models.attention import AttentionMetadata
from pipellm.sampler import logits_by_rows


class Recorder:
    """Hooks on a stage's layers and its attention metadata for the length of one step."""

    def __init__(self, layers: nn.ModuleList, is_sliding: list[bool], meta: AttentionMetadata):
        self.outputs: list[torch.Tensor] = []    # [T, hidden] per layer, the residual stream after it
        self.attention: list[torch.Tensor] = []  # [1, H, K] per layer, when the sequence decodes
        meta.probe = self.attention
        if meta.local is not None:
            meta.local.probe = self.attention
        self.metas = [meta.local if sliding else meta for sliding in is_sliding]
        self.handles = [layer.register_forward_hook(lambda _m, _in, out: self.outputs.append(out)) for layer in layers]

    def close(self) -> None:
        for h in self.handles:
            h.remove()

    def report_fields(self, kv_caches, num_kv_heads: int, seq_len: int) -> dict:
        """ProbeReport's per-layer fields, for a decoding sequence: its new token's attention per KV head, and the
        blocks each layer's cache holds (empty for a prefill)."""
        if not self.attention:
            return {"attention": None, "kv_blocks": [[] for _ in self.metas], "kv_key_rms": [[] for _ in self.metas]}
        a = torch.stack(self.attention)[:, 0, :, :seq_len].cpu()                         # [L, H, K]
        attention = a.view(len(a), num_kv_heads, -1, seq_len).mean(2).numpy()         # [L, KV, group, K] -> [L, KV, K]
        blocks, rms = [], []
        for meta, cache in zip(self.metas, kv_caches):
            table = meta.decode.block_tables[0]
            keys = cache.keys(table, 1, torch.float32)[0, :, :seq_len]                 # [KV, K, D]
            blocks.append(table.tolist())
            rms.append(keys.pow(2).mean((0, 2)).sqrt().tolist())
        return {"attention": attention, "kv_blocks": blocks, "kv_key_rms": rms}


def logit_lens(model: nn.Module, outputs: torch.Tensor, rows: torch.Tensor, tokens: list[int]) -> dict:
    """outputs [layers, T, hidden]: every layer's output for the step's rows. What the final norm and LM head make of
    each: the top token and its probability per row, and the probability of each sampled token (at rows)."""
    num_layers, num_tokens = outputs.shape[:2]
    ids = np.zeros((num_layers, num_tokens), np.int64)
    probs = np.zeros((num_layers, num_tokens), np.float32)
    sampled = np.zeros((num_layers, len(tokens)), np.float32)
    token_ids = torch.tensor(tokens, dtype=torch.long)
    device = next(model.parameters()).device
    for layer in range(num_layers):
        for start, logits in logits_by_rows(model.compute_logits, outputs[layer].to(device)):
            p = torch.softmax(logits, dim=-1).cpu()
            top = p.max(dim=-1)
            ids[layer, start:start + len(p)] = top.indices.numpy()
            probs[layer, start:start + len(p)] = top.values.numpy()
            here = (rows >= start) & (rows < start + len(p))
            if bool(here.any()):
                sampled[layer, here.numpy()] = p[rows[here] - start, token_ids[here]].numpy()
    return {"lens_ids": ids, "lens_probs": probs, "sampled_probs": sampled}
