"""AFMoE (AfmoeForCausalLM, Arcee's Trinity): Gemma's layer order (norms before and after attention and the MLP),
OLMo's norms (scaled in fp32), q/k norms, rotary on the sliding layers only, attention's output gated by a sigmoid of
its own projection (gate_proj, held after q in qkv_proj), and after the first dense layers DeepSeek V3's experts
without groups, beside a shared one."""
from torch import nn

from pipellm.model_config import ModelConfig
from pipellm.models.gemma import GemmaLayer
from pipellm.models.layers import Fp32ScaledRMSNorm
from pipellm.models.llama import LAYER_NAME, LlamaStage, make_mlp


class AfmoeLayer(GemmaLayer):
    def build_mlp(self, cfg: ModelConfig, layer: int) -> nn.Module:
        return make_mlp(cfg, layer)


class AfmoeStage(LlamaStage):
    layer_class, norm_class = AfmoeLayer, Fp32ScaledRMSNorm

    def map_weight(self, name: str) -> list[tuple[str, int]]:
        m = LAYER_NAME.match(name)
        if m and m[2].startswith("self_attn.gate_proj.") and self.stage.start <= int(m[1]) < self.stage.end:
            return [(f"layers.{int(m[1]) - self.stage.start}.self_attn.qkv_proj.{m[2].rpartition('.')[2]}",
                     self.cfg.num_heads * self.cfg.head_dim)]
        return super().map_weight(
            name.replace(".pre_mlp_layernorm.", ".pre_feedforward_layernorm.")
            .replace(".post_mlp_layernorm.", ".post_feedforward_layernorm.").replace(".mlp.router.gate.", ".mlp.gate.")
            .replace(".mlp.expert_bias", ".mlp.selection_bias").replace(".mlp.shared_experts.", ".mlp.shared_expert."))
