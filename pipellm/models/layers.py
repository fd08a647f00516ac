from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from pipellm import kernels
from pipellm.quant.linear import CompactLinear


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the kernel rounds bf16 where HF Llama does: after normalising, and after scaling
        fits = x.dtype == self.weight.dtype in (torch.float32, torch.bfloat16) and x.dim() == 2
        ops = kernels.for_tensor(x) if fits else None
        if ops is not None:  # one call instead of eight small ops (decode steps are made of small ops)
            return ops.rms_norm(x, self.weight, self.eps)
        # Same op order as HF Llama: normalise in fp32, cast back, then scale.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Fp32ScaledRMSNorm(RMSNorm):
    """OLMo 2/3's and GPT-OSS's RMSNorm: scaled by w in fp32, then rounded once (Llama's rounds before scaling too).
    The same as RMSNorm in fp32."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return super().forward(x)
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * y).to(x.dtype)


class CohereLayerNorm(nn.Module):
    """Cohere's LayerNorm: each row less its mean, over its standard deviation, scaled by w (no bias); in fp32,
    rounded once."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.float(), x.shape[-1:], self.weight.float(), None, self.eps).to(x.dtype)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: scaled by 1 + w (the weight is stored as an offset from 1), and in fp32 before the cast."""

    def __init__(self, size: int, eps: float):
        super().__init__(size, eps)
        nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # fp32 only: Gemma scales in fp32 before its one rounding, which the kernel's bf16 rows do not
        ops = kernels.for_tensor(x) if x.dtype == torch.float32 == self.weight.dtype and x.dim() == 2 else None
        if ops is not None:
            return ops.rms_norm(x, 1.0 + self.weight, self.eps)
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).to(x.dtype)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU (silu) or GeGLU (tanh GELU), gate and up in one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str = "silu", bias: bool = False):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act = F.silu if act == "silu" else partial(F.gelu, approximate="tanh")

    def forward(self, x):
        gate_up = self.gate_up_proj(x)                                         # [T, 2 * intermediate]
        return self.down_proj(self.act(gate_up[..., :self.intermediate_size]) * gate_up[..., self.intermediate_size:])


class ReluSquaredMLP(nn.Module):
    """down(relu(up(x)) ** 2): Arcee's MLP, without a gate."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False):
        super().__init__()
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x):
        return self.down_proj(torch.square(F.relu(self.up_proj(x))))


class XieluMLP(ReluSquaredMLP):
    """down(xielu(up(x))): Apertus's MLP, without a gate. xIELU, with learned alpha_p and alpha_n a layer:
    softplus(alpha_p) x^2 + beta x above 0, (beta + softplus(alpha_n)) (expm1(min(x, eps)) - x) + beta x below."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False):
        super().__init__(hidden_size, intermediate_size, bias)
        self.act_fn = nn.Module()  # the checkpoint's names: mlp.act_fn.alpha_p, ...; each [1]
        for name in ("alpha_p", "alpha_n", "beta", "eps"):
            setattr(self.act_fn, name, nn.Parameter(torch.zeros(1), requires_grad=False))

    def forward(self, x):
        a = self.act_fn
        h = self.up_proj(x)
        alpha_p, alpha_n = F.softplus(a.alpha_p), a.beta + F.softplus(a.alpha_n)
        h = torch.where(h > 0, alpha_p * h * h + a.beta * h, (torch.expm1(torch.minimum(h, a.eps)) - h) * alpha_n
                        + a.beta * h)
        return self.down_proj(h)


class GeluMLP(ReluSquaredMLP):
    """down(gelu(up(x))): GPT-NeoX's (exact GELU), Phi's and StarCoder2's (its tanh approximation) MLP."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, exact: bool = False):
        super().__init__(hidden_size, intermediate_size, bias)
        self.approximate = "none" if exact else "tanh"

    def forward(self, x):
        return self.down_proj(F.gelu(self.up_proj(x), approximate=self.approximate))


UNGATED = {"relu2": ReluSquaredMLP, "xielu": XieluMLP}  # Arcee's and Nemotron-H's, Apertus's: up, activation, down


def dense_mlp(hidden_size: int, intermediate_size: int, act: str, bias: bool = False, gated: bool = True) -> nn.Module:
    """An MLP through this activation: ungated (UNGATED, or a GELU with gated=False), or gated by it (SwiGLU,
    GeGLU)."""
    if act in UNGATED:
        return UNGATED[act](hidden_size, intermediate_size, bias=bias)
    if not gated:
        return GeluMLP(hidden_size, intermediate_size, bias, exact=act == "gelu")
    return GatedMLP(hidden_size, intermediate_size, act, bias=bias)


class LayerNorm1p(nn.LayerNorm):
    """Nemotron's LayerNorm: its weight held as an offset from 1."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight + 1.0, self.bias, self.eps)


class TransposedLinear(nn.Module):
    """y = x @ W^T + b with W stored transposed, [in, out] contiguous. On the few-row inputs of decoding,
    MKL runs this layout up to 2x faster than nn.Linear's [out, in] (measured: 16 x 576 x 3072, 1 thread)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight_t = nn.Parameter(linear.weight.detach().t().contiguous(), requires_grad=False)
        self.bias = linear.bias
        self._kernel = None  # the kernels' Linear over weight_t, made on first use on a CPU

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight_t
        if x.dim() == 2 and x.dtype == w.dtype == torch.float32 and (ops := kernels.for_tensor(w)) is not None:
            # up to 64 rows through our kernels (1.1-2.5x MKL's sgemm there), more through addmm: as the fused step
            if self._kernel is None:
                self._kernel = ops.Linear.dense(w, self.bias)
            return self._kernel(x)
        if self.bias is None:
            return x @ w
        return torch.addmm(self.bias, x, w)


class TransposedEmbedding(nn.Module):
    """Token embedding rows read from a tied LM head's weight_t [hidden, vocab]: a stage that holds both keeps one
    copy of the matrix instead of two (the default model in fp32: 113 MB)."""

    def __init__(self, weight_t: nn.Parameter):
        super().__init__()
        self.weight_t = weight_t

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.weight_t[:, ids.reshape(-1)].t().contiguous()                # [T, hidden]
        return rows.reshape(*ids.shape, -1)


def transpose_linears(module: nn.Module) -> None:
    """Replaces every nn.Linear below module (after its weights are loaded) by a TransposedLinear."""
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            setattr(module, name, TransposedLinear(child))
        else:
            transpose_linears(child)


def share_tied_embedding(model: nn.Module) -> None:
    """After transpose_linears: a stage holding both the token embedding and an LM head tied to it (the checkpoint
    fills both from one tensor) reads the embedding from the head's weight, and drops its own copy."""
    head = getattr(model, "lm_head", None)
    for name in ("embed_tokens", "wte"):
        emb = getattr(model, name, None)
        if (isinstance(emb, nn.Embedding) and isinstance(head, TransposedLinear) and head.bias is None
                and emb.weight.shape == head.weight_t.shape[::-1] and emb.weight.dtype == head.weight_t.dtype
                and torch.equal(emb.weight, head.weight_t.t())):
            setattr(model, name, TransposedEmbedding(head.weight_t))


def greedy_head(head: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """Each row's greedy token from x [R, hidden] (the final norm's output), where the LM head finds it without
    every logit (compact weights: CompactLinear.greedy); None where it does not."""
    return head.greedy(x) if isinstance(head, CompactLinear) else None
