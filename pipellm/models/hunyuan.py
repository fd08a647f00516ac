"""Hunyuan dense and MoE (HunYuanDenseV1ForCausalLM, HunYuanMoEV1ForCausalLM): Llama's block with q and k RMS-normed
per head after their rotary (llama.py's norm_after_rope), and a rotary base stretched by NTK alpha (rope_config.py);
the MoE's experts (moe.py) beside a shared MLP as wide as one of them."""
from pipellm.models.llama import LlamaStage


class HunyuanStage(LlamaStage):
    def map_weight(self, name: str) -> list[tuple[str, int]]:
        return super().map_weight(name.replace(".self_attn.query_layernorm.", ".self_attn.q_norm.")
                                  .replace(".self_attn.key_layernorm.", ".self_attn.k_norm.")
                                  .replace(".mlp.gate.wg.", ".mlp.gate.")
                                  .replace(".mlp.shared_mlp.", ".mlp.shared_expert."))
