"""Mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE, GPT-OSS, ERNIE 4.5 MoE, Granite MoE, DeepSeek V2/V3, GLM-4.5,
Llama 4): a router picks top-k experts per token; each expert is a SwiGLU MLP (GPT-OSS: with biases, clamped);
Qwen2-MoE adds a shared expert every token takes (behind a sigmoid gate; ERNIE's, DeepSeek's, GLM's and Llama 4's as
it is), ERNIE, DeepSeek V3 and GLM pick their experts by their score plus a bias, and DeepSeek and GLM from the best
groups of experts only; Llama 4 weighs an expert's input, not its output; Nemotron-H's experts are ungated relu^2
MLPs (Nemotron 3 Super's between a projection down to a latent width and one back up); Phi-MoE picks its two by
sparsemixer.
The stage that holds a layer holds all its experts."""
import torch
from torch import nn

from pipellm.model_config import GROUP_ROUTED, ModelConfig
from pipellm.family_config import AFMOE, NEMOTRON_H
from pipellm.models.layers import GatedMLP, dense_mlp


class ClampedSwiGLU(GatedMLP):
    """GPT-OSS's expert: down((up + 1) * gate * sigmoid(alpha * gate)) + b, gate clamped above at limit and up on both
    sides, gate and up (with their biases) in one matmul: the gates' rows, then the ups'."""

    def __init__(self, hidden_size: int, intermediate_size: int, limit: float, alpha: float):
        super().__init__(hidden_size, intermediate_size, bias=True)
        self.limit, self.alpha = limit, alpha

    def forward(self, x):
        gate_up = self.gate_up_proj(x)                                         # [T, 2 * intermediate]
        gate = gate_up[..., :self.intermediate_size].clamp(max=self.limit)
        up = gate_up[..., self.intermediate_size:].clamp(-self.limit, self.limit)
        return self.down_proj((up + 1) * (gate * torch.sigmoid(gate * self.alpha)))


class SparseMoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        # Mixtral, MiniMax, Hunyuan, DeepSeek and GLM-4.5 multiply by fp32 router weights, Qwen3-MoE by the model's
        # dtype's
        self.weights_in_fp32 = cfg.architecture in ("MixtralForCausalLM", "MiniMaxM2ForCausalLM",
                                                    "HunYuanMoEV1ForCausalLM", NEMOTRON_H, AFMOE) + GROUP_ROUTED
        self.sigmoid, self.scaling, self.norm_eps = cfg.router_sigmoid, cfg.routed_scaling_factor, cfg.router_norm_eps
        self.sparsemixer_eps = cfg.router_jitter_eps  # Phi-MoE's router
        self.average_shared = cfg.shared_expert_average
        self.weigh_inputs = cfg.router_weights_input  # Llama 4: an expert runs on its token times its weight
        self.groups, self.groups_kept, self.by_top_expert = cfg.expert_groups, cfg.expert_groups_kept, \
            cfg.group_by_top_expert
        # GPT-OSS and Granite MoE softmax the top-k logits (GPT-OSS in the model's dtype, Granite in fp32, as HF);
        # GPT-OSS's router has a bias
        self.softmax_after_topk, self.softmax_in_fp32 = cfg.router_softmax_after_topk, not cfg.swiglu_limit
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=cfg.swiglu_limit > 0)
        width = cfg.moe_latent_size or cfg.hidden_size  # what the experts take and give
        self.experts = nn.ModuleList(
            ClampedSwiGLU(cfg.hidden_size, cfg.moe_intermediate_size, cfg.swiglu_limit, cfg.swiglu_alpha)
            if cfg.swiglu_limit else dense_mlp(width, cfg.moe_intermediate_size, cfg.hidden_act)
            for _ in range(cfg.num_experts))
        if cfg.moe_latent_size:  # Nemotron 3 Super's: the experts between a projection down and one back up
            self.fc1_latent_proj = nn.Linear(cfg.hidden_size, width, bias=cfg.mlp_bias)
            self.fc2_latent_proj = nn.Linear(width, cfg.hidden_size, bias=cfg.mlp_bias)
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = dense_mlp(cfg.hidden_size, cfg.shared_expert_intermediate_size, cfg.hidden_act,
                                           bias=cfg.mlp_bias)
            if cfg.shared_expert_gated:
                self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)
        # [E]: added to the probabilities to pick the experts only (ERNIE's moe_statics)
        self.selection_bias = nn.Parameter(torch.zeros(cfg.num_experts), requires_grad=False) \
            if cfg.router_selection_bias else None

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        if self.selection_bias is not None:  # fp32 whatever the dtype (as HF): it moves picks among close scores
            self.selection_bias.data = self.selection_bias.data.float()
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sparsemixer_eps:
            weights, chosen = sparsemixer(self.gate(x), self.sparsemixer_eps)
        elif self.softmax_after_topk:
            top, chosen = torch.topk(self.gate(x), self.top_k, dim=-1)                   # [T, k]
            weights = torch.softmax(top.float() if self.softmax_in_fp32 else top, dim=-1).to(x.dtype)
        else:
            logits = self.gate(x)
            probs = torch.sigmoid(logits.float()) if self.sigmoid else torch.softmax(logits, -1, dtype=torch.float32)
            if self.selection_bias is None and self.groups == 1:
                weights, chosen = torch.topk(probs, self.top_k, dim=-1)                  # [T, k]
            else:
                choice = probs if self.selection_bias is None else probs + self.selection_bias
                chosen = torch.topk(self.best_groups(choice), self.top_k, dim=-1)[1]
                weights = probs.gather(-1, chosen)
            if self.norm_topk_prob:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + self.norm_eps)
            if self.scaling != 1:
                weights = weights * self.scaling
            if not self.weights_in_fp32:
                weights = weights.to(x.dtype)
        latent = hasattr(self, "fc1_latent_proj")
        out = run_experts(self.experts, self.fc1_latent_proj(x) if latent else x, weights, chosen, self.weigh_inputs)
        if latent:
            out = self.fc2_latent_proj(out)
        if hasattr(self, "shared_expert_gate"):
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        elif hasattr(self, "shared_expert"):
            out = out + self.shared_expert(x)
            if self.average_shared:  # Cohere 2 MoE's
                out = out / 2
        return out

    def best_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """choice [T, E] with every expert outside each token's groups_kept best groups at -inf. A group's score:
        its best expert's (DeepSeek V2), or its best two's sum (V3, Mistral 4)."""
        if self.groups == 1:
            return choice
        grouped = choice.view(len(choice), self.groups, -1)                              # [T, G, E / G]
        score = grouped.amax(-1) if self.by_top_expert else grouped.topk(2, dim=-1)[0].sum(-1)  # [T, G]
        dropped = torch.ones_like(score, dtype=torch.bool).scatter_(
            1, torch.topk(score, self.groups_kept, dim=-1)[1], False)                   # [T, G]
        return grouped.masked_fill(dropped[..., None], float("-inf")).view_as(choice)


def run_experts(experts: nn.ModuleList, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor,
                weigh_inputs: bool = False) -> torch.Tensor:
    """x [T, width] through each token's chosen experts [T, k], their outputs (with weigh_inputs their inputs)
    weighed [T, k] and summed. Tokens batched per expert: the (token, slot) pairs sorted by expert, one matmul per
    expert hit."""
    order = chosen.flatten().argsort(stable=True)                                        # [T * k]
    counts = torch.bincount(chosen.flatten(), minlength=len(experts)).tolist()
    tokens, weights = order // chosen.shape[1], weights.flatten()[order]
    out, start = torch.zeros_like(x), 0
    for expert, count in zip(experts, counts):
        if count:
            rows, w = tokens[start:start + count], weights[start:start + count, None]
            out.index_add_(0, rows, expert(x[rows] * w) if weigh_inputs else (expert(x[rows]) * w).to(x.dtype))
            start += count
    return out


def sparsemixer(logits: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Phi-MoE's router at inference, as HF's sparsemixer: (weights, experts) [T, 2]. Two picks in turn, each the
    best expert left; its weight is its softmax over the experts left whose logits lie within 2 eps of its (relative
    to the larger magnitude), the others masked."""
    left, weights, chosen = logits, [], []
    for _ in range(2):
        top, pick = left.max(dim=-1, keepdim=True)                                        # [T, 1]
        far = (top - logits) / logits.abs().clamp(min=top) > 2 * eps                     # [T, E]
        weights.append(torch.softmax(left.masked_fill(far, float("-inf")), dim=-1).gather(-1, pick))
        chosen.append(pick)
        left = left.scatter(-1, pick, float("-inf"))
    return torch.cat(weights, -1), torch.cat(chosen, -1)
