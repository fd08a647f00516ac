"""Layers that keep a fixed-size state per sequence instead of every past key and value: Qwen3-Next's and Qwen3.5's
gated delta nets (Yang et al., "Gated Delta Networks"), the Mamba-2 mixers of Granite 4.0-H, Nemotron-H and Falcon-H1
(Dao and Gu, "Transformers are SSMs"), Jamba's Mamba mixers and LFM2's gated short convolutions. All keep the last few
inputs of a short causal convolution, and all but LFM2's a matrix per head: the delta net's [key width, value width],
which each token decays, corrects towards its value (the delta rule) and reads with its query; Mamba-2's [head width,
state width], which each token decays and adds its input to, read through C (Mamba's one [width, state width], decayed
channel by channel). The state lives on the stage with the layer (LinearState), a row per sequence (the row of the
block tables the driver gives it); a sequence whose step starts at position 0 starts from zeros, every other step goes
on from the state its last step left. With prefix caching, a layer also keeps saved states (LinearState.saved, by
slot): a sequence's state after its first tokens, copied there mid-step where the driver asks
(AttentionMetadata.state_saves) and copied back into a later sequence's row that starts after the same tokens (a
StageBatch's state_loads)."""
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pipellm.model_config import ModelConfig
from pipellm.models.attention import AttentionMetadata
from pipellm.models.kv_cache import KVCache
from pipellm.models.layers import RMSNorm

CHUNK = 64  # tokens a prompt's delta rule runs at once, as matrices (the chunked form HF's and FLA's kernels use)


@dataclass
class LinearState:
    """One linear-attention layer's state, a row per sequence; rows are added as the driver's row numbers grow."""
    conv: torch.Tensor  # [R, C, kernel - 1] the convolution's last inputs, in the activations' dtype
    ssm: torch.Tensor   # [R, Hv, Dk, Dv] fp32, the delta rule's matrix per value head
    saved: "LinearState | None" = None  # states kept for prefix caching, by the driver's slot numbers

    @classmethod
    def allocate(cls, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str = "cpu",
                 rows: int = 0) -> "LinearState":
        channels, kernel, matrices = state_shapes(cfg)
        return cls(torch.zeros(rows, channels, kernel - 1, dtype=dtype, device=device),
                   torch.zeros(rows, *matrices, device=device))

    @property
    def nbytes(self) -> int:
        return self.conv.nbytes + self.ssm.nbytes + (self.saved.nbytes if self.saved is not None else 0)

    def save(self, row: int, slot: int) -> None:
        if self.saved is None:
            self.saved = LinearState(self.conv[:0].clone(), self.ssm[:0].clone())
        self.saved.grow(slot + 1)
        self.saved.conv[slot], self.saved.ssm[slot] = self.conv[row], self.ssm[row]

    def load(self, slot: int, row: int) -> None:
        if self.saved is None or slot >= len(self.saved.conv):
            raise ValueError(f"state_loads: slot {slot} holds no saved state")
        self.grow(row + 1)
        self.conv[row], self.ssm[row] = self.saved.conv[slot], self.saved.ssm[slot]

    def grow(self, rows: int) -> None:
        """Room for rows 0..rows-1, as the block tables' rows grow (by a quarter at least, not doubling: a row of
        Qwen3-Next-80B's is 2 MiB a layer)."""
        have = len(self.conv)
        if rows <= have:
            return
        new = max(rows, have + max(8, have // 4))
        self.conv = torch.cat([self.conv, self.conv.new_zeros(new - have, *self.conv.shape[1:])])
        self.ssm = torch.cat([self.ssm, self.ssm.new_zeros(new - have, *self.ssm.shape[1:])])


@dataclass
class KVAndState:
    """A layer's KV cache and its state, where attention and a Mamba-2 mixer run side by side (Falcon-H1's)."""
    kv: KVCache
    state: LinearState

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes + self.state.nbytes


def layer_cache(cfg: ModelConfig, layer: int, dtype: torch.dtype, device, kv_cache):
    """What a layer keeps between steps: its KV cache (kv_cache() makes it), its state, both (Falcon-H1's) or
    nothing (Nemotron-H's MLP layers)."""
    kv = kv_cache() if cfg.has_kv_cache(layer) else None
    if not cfg.is_linear(layer):
        return kv
    state = LinearState.allocate(cfg, dtype, device)
    return state if kv is None else KVAndState(kv, state)


def state_shapes(cfg: ModelConfig) -> tuple[int, int, tuple[int, ...]]:
    """(convolution channels, its kernel, the matrices' shape: [heads, rows, columns]; Mamba-1's [width, state]) of a
    layer's state."""
    if cfg.short_conv:  # the convolution's inputs alone
        return cfg.hidden_size, cfg.short_conv, (0,)
    if cfg.mamba1:
        inner, width, kernel, _ = cfg.mamba1
        return inner, kernel, (inner, width)
    if cfg.mamba:
        heads, head_dim, groups, width, kernel = cfg.mamba
        return heads * head_dim + 2 * groups * width, kernel, (heads, head_dim, width)
    hk, hv, dk, dv, kernel = cfg.linear_attention
    return 2 * hk * dk + hv * dv, kernel, (hv, dk, dv)


def state_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of one sequence's state in one linear-attention layer."""
    channels, kernel, matrices = state_shapes(cfg)
    return channels * (kernel - 1) * dtype.itemsize + math.prod(matrices) * 4


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


def ssd_chunked(x, dt, A, B, C, state):
    """Mamba-2's scan over one sequence's tokens at once. x [L, H, P], dt [L, H] (after softplus), A [H] (negative),
    B and C [L, H, N] (each head's group's), state [H, P, N]: all fp32. Returns y [L, H, P] (without D's skip) and
    the state after the last token. Within a chunk the outputs are one masked product (its "attention" form), then
    the state steps a chunk at a time."""
    L, H = dt.shape
    pad = -L % CHUNK
    # [L, H, D] -> [H, chunks, CHUNK, D]
    xdt, B, C = (F.pad(t, (0, 0, 0, 0, 0, pad)).transpose(0, 1).reshape(H, -1, CHUNK, t.shape[2])
                 for t in (x * dt[..., None], B, C))
    decay = F.pad(dt * A, (0, 0, 0, pad)).t().reshape(H, -1, CHUNK).cumsum(-1)   # [H, N, C] log decay from its start
    later = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=x.device).triu(1)
    between = (decay[..., :, None] - decay[..., None, :]).masked_fill(later, float("-inf")).exp()  # [H, N, C, C]
    inner = ((C @ B.transpose(-1, -2)) * between) @ xdt                                     # [H, N, C, P]
    c_decayed = C * decay.exp()[..., None]
    b_to_end = B * (decay[..., -1:] - decay).exp()[..., None]
    chunk_decay = decay[..., -1].exp()[..., None, None]                                     # [H, N, 1, 1]
    out = torch.empty_like(inner)
    for n in range(inner.shape[1]):
        out[:, n] = inner[:, n] + c_decayed[:, n] @ state.transpose(-1, -2)
        state = state * chunk_decay[:, n] + xdt[:, n].transpose(-1, -2) @ b_to_end[:, n]
    return out.reshape(H, -1, out.shape[-1])[:, :L].transpose(0, 1), state                 # [L, H, P]


def ssd_step(x, dt, A, B, C, state):
    """One token of each of S sequences: x [S, H, P], dt [S, H], A [H], B and C [S, H, N]; state [S, H, P, N]
    (fp32, contiguous) updated in place. Returns y [S, H, P] (without D's skip)."""
    state.mul_((dt * A).exp()[..., None, None])
    state.add_((x * dt[..., None])[..., None] * B[:, :, None, :])
    return (state @ C[..., None])[..., 0]


def causal_conv(inputs: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """inputs [..., C, kernel - 1 + n], weight [C, kernel] -> [..., C, n]: each channel's outputs over its last kernel
    inputs. (A sum of shifted slices: half the time of a depthwise conv1d here.)"""
    n = inputs.shape[-1] - weight.shape[-1] + 1
    out = inputs[..., :n] * weight[:, :1]
    for j in range(1, weight.shape[-1]):
        out += inputs[..., j:j + n] * weight[:, j:j + 1]
    return out


def row_index(rows: torch.Tensor) -> slice | torch.Tensor:
    """rows as a slice where they are consecutive (a decode step's usually are): indexing with it gives views, updated
    in place; else as they are, which gives copies, to write back."""
    first = int(rows[0])
    if bool((rows == torch.arange(first, first + len(rows), device=rows.device)).all()):
        return slice(first, first + len(rows))
    return rows


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


class StateMixer(nn.Module):
    """What both mixers share: each sequence's row of the states (reset where its step starts at position 0), and
    the causal convolution over the state's last inputs, decodes together and each prompt chunk on its own."""

    def rows(self, meta: AttentionMetadata, state: LinearState, device: torch.device) -> torch.Tensor:
        rows = meta.state_rows if meta.state_rows is not None else torch.arange(len(meta.query_lens), device=device)
        state.grow(int(rows.max()) + 1)
        fresh = rows[meta.seq_lens == meta.query_lens]  # sequences starting at position 0: from zeros
        if len(fresh):
            state.conv[fresh], state.ssm[fresh] = 0, 0
        return rows

    def convolve_and_scan(self, conv_in: torch.Tensor, meta: AttentionMetadata, state: LinearState, step, chunked,
                          out: torch.Tensor) -> torch.Tensor:
        """conv_in [T, C]: each sequence's new inputs. step(mixed [S, C], idx, matrices [S, ...]) updates the
        matrices in place and returns the decodes' outputs; chunked(mixed [n, C], rows slice, matrices) returns a
        prompt chunk's outputs and the matrices after it. Fills out [T, ...] with them."""
        rows = self.rows(meta, state, conv_in.device)
        lens = meta.query_lens.tolist()
        starts = [0]
        for n in lens:
            starts.append(starts[-1] + n)
        single = [i for i, n in enumerate(lens) if n == 1]
        if single:  # the decodes together, one token each (every row of a decode step: no gathers)
            every = len(single) == len(lens)
            idx = slice(None) if every else torch.tensor([starts[i] for i in single], device=conv_in.device)
            r = rows if every else rows[single]
            at = row_index(r)
            conv, matrices = state.conv[at], state.ssm[at]                              # [S, C, kernel - 1], [S, ...]
            window = torch.cat([conv, conv_in[idx, :, None].to(conv.dtype)], -1)             # [S, C, kernel]
            out[idx] = step(self.activate(causal_conv(window, self.conv_weight)[..., 0]), idx, matrices)
            if isinstance(at, slice):  # the matrices were updated in place
                conv.copy_(window[..., 1:])
            else:
                state.conv[at], state.ssm[at] = window[..., 1:], matrices
        saves = meta.state_saves or {}
        for i, at_tokens in saves.items():  # a decode's (or one-token chunk's) saves: after its token
            if lens[i] == 1:
                for _, slot in at_tokens:
                    state.save(int(rows[i]), slot)
        for i, n in enumerate(lens):  # each prompt chunk on its own, from its sequence's state
            if n == 1:
                continue
            r, a = int(rows[i]), 0
            # cut where a state is saved: after k of its tokens
            for b, slot in [*saves.get(i, ()), (n, None)]:
                if b > a:
                    s = slice(starts[i] + a, starts[i] + b)
                    inputs = torch.cat([state.conv[r], conv_in[s].t().to(state.conv.dtype)], -1)  # [C, kernel-1+n]
                    state.conv[r] = inputs[:, -state.conv.shape[-1]:]
                    out[s], state.ssm[r] = chunked(self.activate(causal_conv(inputs, self.conv_weight).t()), s,
                                                   state.ssm[r])
                    a = b
                if slot is not None:
                    state.save(r, slot)
        return out

    def activate(self, conv_out: torch.Tensor) -> torch.Tensor:
        bias = getattr(self, "conv_bias", None)
        return F.silu(conv_out if bias is None else conv_out + bias)


class GatedDeltaNet(StateMixer):
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
        qkv, z, b, a = self.in_proj(x).split([self.conv_dim, self.value_dim, self.hv, self.hv], -1)
        beta = b.sigmoid().float()                                                             # [T, Hv]
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())         # [T, Hv]

        def step(mixed, idx, matrices):
            return delta_rule_step(*self._heads(mixed, g[idx], beta[idx]), matrices).to(x.dtype)

        def chunked(mixed, s, matrices):
            o, matrices = delta_rule_chunked(*self._heads(mixed, g[s], beta[s]), matrices)
            return o.to(x.dtype), matrices
        out = self.convolve_and_scan(qkv, meta, state, step, chunked, x.new_empty(len(x), self.hv, self.dv))
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


class GroupGatedRMSNorm(nn.Module):
    """Mamba-2's: gated by silu(z) first, then RMS-normed over each group's channels, scaled by w (fp32, one
    rounding before the scale); with norm_before_gate (Falcon-H1's option) normed, scaled, then gated, in fp32."""

    def __init__(self, size: int, groups: int, eps: float, norm_before_gate: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.groups, self.eps, self.norm_before_gate = groups, eps, norm_before_gate

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        gate, y = F.silu(z.float()), x.float()
        if not self.norm_before_gate:
            y = y * gate
        y = y.view(len(x), self.groups, -1)                                                  # [T, G, C / G]
        y = (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)).view(len(x), -1)
        if self.norm_before_gate:
            return (self.weight.float() * y * gate).to(x.dtype)
        return self.weight * y.to(x.dtype)


class Mamba2Mixer(StateMixer):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.heads, self.head_dim, self.groups, self.width, kernel = cfg.mamba
        self.inner = self.heads * self.head_dim
        self.conv_dim = self.inner + 2 * self.groups * self.width
        # the output gate z, then x, B and C (convolved), then dt per head, in one matmul
        self.in_proj = nn.Linear(cfg.hidden_size, self.inner + self.conv_dim + self.heads, bias=cfg.mamba_proj_bias)
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, kernel))  # HF's conv1d.weight [C, 1, kernel]
        if cfg.mamba_conv_bias:
            self.conv_bias = nn.Parameter(torch.zeros(self.conv_dim))
        self.dt_bias = nn.Parameter(torch.ones(self.heads))
        self.A_log = nn.Parameter(torch.zeros(self.heads))
        self.D = nn.Parameter(torch.ones(self.heads))
        if cfg.mamba_norm != "none":  # else (Falcon-H1's option) the output only gated
            self.norm = GroupGatedRMSNorm(self.inner, self.groups, cfg.norm_eps, cfg.mamba_norm == "norm_then_gate")
        self.out_proj = nn.Linear(self.inner, cfg.hidden_size, bias=cfg.mamba_out_bias)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """[T, hidden] -> z, x, B, C and dt [T, inner + conv + heads]."""
        return self.in_proj(x)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, state: LinearState) -> torch.Tensor:
        z, xbc, dt = self.project(x).split([self.inner, self.conv_dim, self.heads], -1)
        dt = F.softplus(dt.float() + self.dt_bias.float())                                   # [T, H]
        A = -self.A_log.float().exp()

        def step(mixed, idx, matrices):
            xs, B, C = self._heads(mixed)
            return (ssd_step(xs, dt[idx], A, B, C, matrices) + xs * self.D.float()[:, None]).to(x.dtype)

        def chunked(mixed, s, matrices):
            xs, B, C = self._heads(mixed)
            y, matrices = ssd_chunked(xs, dt[s], A, B, C, matrices)
            return (y + xs * self.D.float()[:, None]).to(x.dtype), matrices
        out = self.convolve_and_scan(xbc, meta, state, step, chunked, x.new_empty(len(x), self.heads, self.head_dim))
        out = out.reshape(len(x), self.inner)
        if not hasattr(self, "norm"):
            return self.out_proj((out.float() * F.silu(z.float())).to(x.dtype))
        return self.out_proj(self.norm(out, z))

    def _heads(self, mixed: torch.Tensor) -> tuple:
        """The convolution's output [T, C] as fp32 x [T, H, P] and each head's group's B and C [T, H, N]."""
        xs, B, C = mixed.float().split([self.inner, self.groups * self.width, self.groups * self.width], -1)
        B, C = (t.reshape(len(t), self.groups, self.width).repeat_interleave(self.heads // self.groups, 1)
                for t in (B, C))
        return xs.reshape(len(xs), self.heads, self.head_dim), B, C


class Mamba1Mixer(StateMixer):
    """Jamba's Mamba (Gu and Dao, "Mamba"): a state [width, state width] per sequence that each token decays channel
    by channel (exp(dt A)) and adds dt x B to, read through C; dt, B and C from the convolved input, RMS-normed."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.inner, self.width, kernel, self.rank = cfg.mamba1
        self.in_proj = nn.Linear(cfg.hidden_size, 2 * self.inner, bias=cfg.mamba_proj_bias)  # x, then the gate z
        self.conv_weight = nn.Parameter(torch.empty(self.inner, kernel))
        if cfg.mamba_conv_bias:
            self.conv_bias = nn.Parameter(torch.zeros(self.inner))
        self.x_proj = nn.Linear(self.inner, self.rank + 2 * self.width, bias=False)  # dt (low rank), B, C
        self.dt_proj = nn.Linear(self.rank, self.inner)
        self.A_log = nn.Parameter(torch.zeros(self.inner, self.width))
        self.D = nn.Parameter(torch.ones(self.inner))
        self.out_proj = nn.Linear(self.inner, cfg.hidden_size, bias=cfg.mamba_proj_bias)
        self.dt_layernorm, self.b_layernorm, self.c_layernorm = (
            RMSNorm(n, cfg.norm_eps) for n in (self.rank, self.width, self.width))

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, state: LinearState) -> torch.Tensor:
        xs, z = self.in_proj(x).chunk(2, -1)
        A = -self.A_log.float().exp()                                                       # [width, state]

        def step(mixed, idx, matrices):  # matrices [S, width, state], updated in place
            u, dt, B, C = self._inputs(mixed)
            matrices.mul_((dt[..., None] * A).exp()).add_((dt * u)[..., None] * B[:, None])
            return ((matrices @ C[..., None])[..., 0] + u * self.D.float()).to(x.dtype)

        def chunked(mixed, s, matrices):
            u, dt, B, C = self._inputs(mixed)
            out = torch.empty_like(u)
            for a in range(0, len(u), CHUNK):  # CHUNK tokens' decays and inputs at once, [n, width, state] each
                b = min(a + CHUNK, len(u))
                decay = (dt[a:b, :, None] * A).exp()
                states = (dt[a:b] * u[a:b])[..., None] * B[a:b, None]
                for t in range(b - a):  # token by token: a state is its input plus its predecessor decayed
                    torch.addcmul(states[t], decay[t], states[t - 1] if t else matrices, out=states[t])
                out[a:b] = (states @ C[a:b, :, None])[..., 0]
                matrices = states[-1].clone()
            return (out + u * self.D.float()).to(x.dtype), matrices
        out = self.convolve_and_scan(xs, meta, state, step, chunked, x.new_empty(len(x), self.inner))
        return self.out_proj((out.float() * F.silu(z.float())).to(x.dtype))

    def _inputs(self, mixed: torch.Tensor) -> tuple:
        """The convolution's output [T, width] as fp32 u, dt [T, width], B and C [T, state]."""
        dt, B, C = self.x_proj(mixed).split([self.rank, self.width, self.width], -1)
        dt = F.softplus(self.dt_proj(self.dt_layernorm(dt)).float())
        return mixed.float(), dt, self.b_layernorm(B).float(), self.c_layernorm(C).float()


class ShortConv(StateMixer):
    """LFM2's gated short convolution: B x (both from in_proj, per token) convolved over the last few tokens, then
    gated by C; its state is the convolution's last inputs alone (no matrices)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h = cfg.hidden_size
        self.in_proj = nn.Linear(h, 3 * h, bias=cfg.mamba_proj_bias)  # B, C, then x
        self.conv_weight = nn.Parameter(torch.empty(h, cfg.short_conv))
        if cfg.mamba_conv_bias:
            self.conv_bias = nn.Parameter(torch.zeros(h))
        self.out_proj = nn.Linear(h, h, bias=cfg.mamba_proj_bias)

    def activate(self, conv_out: torch.Tensor) -> torch.Tensor:  # its bias alone: no activation
        bias = getattr(self, "conv_bias", None)
        return conv_out if bias is None else conv_out + bias

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, state: LinearState) -> torch.Tensor:
        b, c, xs = self.in_proj(x).chunk(3, -1)

        def step(mixed, idx, matrices):
            return c[idx] * mixed

        def chunked(mixed, s, matrices):
            return c[s] * mixed, matrices
        return self.out_proj(self.convolve_and_scan(b * xs, meta, state, step, chunked, torch.empty_like(x)))
