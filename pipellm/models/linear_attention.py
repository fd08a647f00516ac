"""Qwen3-Next's and Qwen3.5's linear-attention layers: a gated delta net (Yang et al., "Gated Delta Networks").
Where an attention layer keeps every past key and value, this one keeps a fixed-size state per sequence: the last
few inputs of a short causal convolution, and a [key width, value width] matrix per value head that each token
decays, corrects towards its value (the delta rule) and reads with its query. The state lives on the stage with the
layer (LinearState), a row per sequence (the row of the block tables the driver gives it); a sequence whose step
starts at position 0 starts from zeros, every other step goes on from the state its last step left."""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pipellm.model_config import ModelConfig
from pipellm.models.attention import AttentionMetadata

CHUNK = 64  # tokens a prompt's delta rule runs at once, as matrices (the chunked form HF's and FLA's kernels use)


@dataclass
class LinearState:
    """One linear-attention layer's state, a row per sequence; rows are added as the driver's row numbers grow."""
    conv: torch.Tensor  # [R, C, kernel - 1] the convolution's last inputs, in the activations' dtype
    ssm: torch.Tensor   # [R, Hv, Dk, Dv] fp32, the delta rule's matrix per value head

    @classmethod
    def allocate(cls, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str = "cpu",
                 rows: int = 0) -> "LinearState":
        hk, hv, dk, dv, kernel = cfg.linear_attention
        return cls(torch.zeros(rows, 2 * hk * dk + hv * dv, kernel - 1, dtype=dtype, device=device),
                   torch.zeros(rows, hv, dk, dv, device=device))

    @property
    def nbytes(self) -> int:
        return self.conv.nbytes + self.ssm.nbytes

    def grow(self, rows: int) -> None:
        """Room for rows 0..rows-1, as the block tables' rows grow (by a quarter at least, not doubling: a row of
        Qwen3-Next-80B's is 2 MiB a layer)."""
        have = len(self.conv)
        if rows <= have:
            return
        new = max(rows, have + max(8, have // 4))
        self.conv = torch.cat([self.conv, self.conv.new_zeros(new - have, *self.conv.shape[1:])])
        self.ssm = torch.cat([self.ssm, self.ssm.new_zeros(new - have, *self.ssm.shape[1:])])


def state_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of one sequence's state in one linear-attention layer."""
    hk, hv, dk, dv, kernel = cfg.linear_attention
    return (2 * hk * dk + hv * dv) * (kernel - 1) * dtype.itemsize + hv * dk * dv * 4


def l2_normed(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def delta_rule_chunked(q, k, v, g, beta, state):
    """One sequence's tokens at once. q, k [L, H, Dk] (l2-normed, q scaled), v [L, H, Dv], g (log decay) and beta
    [L, H], state [H, Dk, Dv]: all fp32. Returns the outputs [L, H, Dv] and the state after the last token. Within a
    chunk of CHUNK tokens the updates are solved as one triangular system (the WY form), then the state steps a
    chunk at a time."""
    L = len(q)
    pad = -L % CHUNK
    # [L, H, D] -> [H, chunks, CHUNK, D]
    q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)).transpose(0, 1).reshape(x.shape[1], -1, CHUNK, x.shape[2])
               for x in (q, k, v))
    g, beta = (F.pad(x, (0, 0, 0, pad)).t().reshape(x.shape[1], -1, CHUNK) for x in (g, beta))
    decay = g.cumsum(-1)                                                        # [H, N, C] log decay from chunk start
    later = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu(1)
    # decay from token j to token i of a chunk (i >= j), 0 above the diagonal
    between = (decay[..., :, None] - decay[..., None, :]).masked_fill(later, float("-inf")).exp()  # [H, N, C, C]
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    # (I + its part below the diagonal) x = rhs: each token's correction, given those before it in its chunk
    system = (k_beta @ k.transpose(-1, -2)) * between                                            # [H, N, C, C]
    u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)           # [H, N, C, Dv]
    w = torch.linalg.solve_triangular(system, k_beta * decay.exp()[..., None], upper=False,
                                      unitriangular=True)                                        # [H, N, C, Dk]
    inner = (q @ k.transpose(-1, -2)) * between                                                # [H, N, C, C]
    q_decayed = q * decay.exp()[..., None]
    k_to_end = k * (decay[..., -1:] - decay).exp()[..., None]
    chunk_decay = decay[..., -1].exp()[..., None, None]                                        # [H, N, 1, 1]
    out = torch.empty_like(u)
    for n in range(q.shape[1]):
        new = u[:, n] - w[:, n] @ state                                        # [H, C, Dv] what the state lacks
        out[:, n] = q_decayed[:, n] @ state + inner[:, n] @ new
        state = state * chunk_decay[:, n] + k_to_end[:, n].transpose(-1, -2) @ new
    return out.reshape(out.shape[0], -1, out.shape[-1])[:, :L].transpose(0, 1), state  # [L, H, Dv]


def delta_rule_step(q, k, v, g, beta, state):
    """One token of each of S sequences: q, k [S, H, Dk], v [S, H, Dv], g and beta [S, H]; state [S, H, Dk, Dv]
    (fp32, contiguous) updated in place. Returns the outputs [S, H, Dv]."""
    S, H, Dk, Dv = state.shape
    state.mul_(g.exp()[..., None, None])
    flat = state.view(S * H, Dk, Dv)
    known = torch.bmm(k.reshape(S * H, 1, Dk), flat)                               # [S * H, 1, Dv] what it holds
    delta = (v.reshape(S * H, 1, Dv) - known) * beta.reshape(S * H, 1, 1)
    flat.baddbmm_(k.reshape(S * H, Dk, 1), delta)                                  # + k delta^T, no temporary
    return torch.bmm(q.reshape(S * H, 1, Dk), flat).view(S, H, Dv)


def causal_conv(inputs: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """inputs [..., C, kernel - 1 + n], weight [C, kernel] -> [..., C, n]: each channel's outputs over its last kernel
    inputs. (A sum of shifted slices: half the time of a depthwise conv1d here.)"""
    n = inputs.shape[-1] - weight.shape[-1] + 1
    out = inputs[..., :n] * weight[:, :1]
    for j in range(1, weight.shape[-1]):
        out += inputs[..., j:j + n] * weight[:, j:j + 1]
    return out


def at_rows(t: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """t's rows: a view where they are consecutive (as a decode step's usually are), to update in place; else a
    copy, to write back. Returns it and whether it is a view."""
    first = int(rows[0])
    if bool((rows == torch.arange(first, first + len(rows), device=rows.device)).all()):
        return t[first:first + len(rows)], True
    return t[rows], False


class GatedRMSNorm(nn.Module):
    """RMSNorm over each value head's output, scaled by w, then gated by silu(z) (in fp32, rounded once)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = (self.weight * (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)).float()
        return (y * F.silu(z.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.hk, self.hv, self.dk, self.dv, kernel = cfg.linear_attention
        self.key_dim, self.value_dim = self.hk * self.dk, self.hv * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        # q, k, v, then the output gate z and the per-head b (beta) and a (decay) in one matmul
        self.in_proj = nn.Linear(cfg.hidden_size, self.conv_dim + self.value_dim + 2 * self.hv, bias=False)
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, kernel))  # HF's conv1d.weight [C, 1, kernel]
        # llama.cpp's qwen35 files hold the value heads tiled (head h of key head h % Hk), not grouped (h // r)
        self.tiled = cfg.linear_heads_tiled
        self.dt_bias = nn.Parameter(torch.ones(self.hv))
        self.A_log = nn.Parameter(torch.zeros(self.hv))
        self.norm = GatedRMSNorm(self.dv, cfg.norm_eps)
        self.out_proj = nn.Linear(self.value_dim, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, state: LinearState) -> torch.Tensor:
        proj = self.in_proj(x)
        qkv, z, b, a = proj.split([self.conv_dim, self.value_dim, self.hv, self.hv], -1)
        rows = meta.state_rows if meta.state_rows is not None else torch.arange(len(meta.query_lens),
                                                                                device=x.device)
        state.grow(int(rows.max()) + 1)
        fresh = rows[meta.seq_lens == meta.query_lens]  # sequences starting at position 0: from zeros
        if len(fresh):
            state.conv[fresh], state.ssm[fresh] = 0, 0
        lens = meta.query_lens.tolist()
        starts = [0]
        for n in lens:
            starts.append(starts[-1] + n)
        single = [i for i, n in enumerate(lens) if n == 1]
        out = x.new_empty(len(x), self.hv, self.dv)
        beta = b.sigmoid().float()                                                             # [T, Hv]
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())         # [T, Hv]
        if single:  # the decodes together, one token each (every row of a decode step: no gathers)
            every = len(single) == len(lens)
            idx = slice(None) if every else torch.tensor([starts[i] for i in single], device=x.device)
            r = rows if every else rows[single]
            conv, in_place = at_rows(state.conv, r)                                          # [S, C, kernel - 1]
            window = torch.cat([conv, qkv[idx, :, None].to(conv.dtype)], -1)                 # [S, C, kernel]
            mixed = F.silu(causal_conv(window, self.conv_weight)[..., 0])                      # [S, C]
            ssm, _ = at_rows(state.ssm, r)                                                  # [S, Hv, Dk, Dv]
            out[idx] = delta_rule_step(*self._heads(mixed, g[idx], beta[idx]), ssm).to(x.dtype)
            if in_place:
                conv.copy_(window[..., 1:])
            else:
                state.conv[r], state.ssm[r] = window[..., 1:], ssm
        for i, n in enumerate(lens):  # each prompt chunk on its own, from its sequence's state
            if n == 1:
                continue
            r, s = int(rows[i]), slice(starts[i], starts[i] + n)
            inputs = torch.cat([state.conv[r], qkv[s].t().to(state.conv.dtype)], -1)        # [C, kernel - 1 + n]
            state.conv[r] = inputs[:, -state.conv.shape[-1]:]
            mixed = F.silu(causal_conv(inputs, self.conv_weight).t())                          # [n, C]
            o, state.ssm[r] = delta_rule_chunked(*self._heads(mixed, g[s], beta[s]), state.ssm[r])
            out[s] = o.to(x.dtype)
        out = self.norm(out, z.reshape(-1, self.hv, self.dv))                               # [T, Hv, Dv]
        return self.out_proj(out.reshape(len(x), self.value_dim))

    def _heads(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> tuple:
        """The convolution's output [T, C] as the delta rule's fp32 q, k (each key head serving Hv / Hk value heads)
        and v, with g and beta."""
        q, k, v = mixed.float().split([self.key_dim, self.key_dim, self.value_dim], -1)
        r = self.hv // self.hk
        q, k = (l2_normed(t.reshape(len(t), self.hk, self.dk)) for t in (q, k))
        q, k = (t.repeat(1, r, 1) if self.tiled else t.repeat_interleave(r, 1) for t in (q, k))  # [T, Hv, Dk]
        return q * self.dk ** -0.5, k, v.reshape(len(v), self.hv, self.dv), g, beta
