"""Rotary positions of one kind of layer as HF's rope_parameters (rope_scaling) give them: RopeConfig, read by
model_config.py's ModelConfig and turned by models/rotary.py."""
from dataclasses import dataclass

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope", "proportional")


@dataclass
class RopeConfig:
    """Rotary positions of one kind of layer, as HF's rope_parameters (rope_scaling) give them."""
    rope_type: str = "default"      # one of ROPE_TYPES
    theta: float = 10000.0          # base
    partial_rotary_factor: float = 1.0  # share of head_dim that is rotated (Phi-4-mini: 0.75; proportional: see
    #                                     models/rotary.py)
    factor: float = 1.0             # linear, dynamic, llama3, yarn, longrope, proportional
    original_max_position_embeddings: int = 0  # llama3, yarn, longrope: the pretraining context
    low_freq_factor: float = 1.0    # llama3
    high_freq_factor: float = 4.0   # llama3
    attention_factor: float | None = None  # yarn, longrope: scale on cos/sin; None = from factor
    beta_fast: float = 32.0         # yarn
    beta_slow: float = 1.0          # yarn
    mscale: float = 0.0             # yarn (DeepSeek style, with mscale_all_dim)
    mscale_all_dim: float = 0.0
    truncate: bool = True           # yarn: round the correction range
    short_factor: tuple[float, ...] = ()  # longrope, per rotated frequency
    long_factor: tuple[float, ...] = ()
    freq_factors: tuple[float, ...] = ()  # llama.cpp's rope_freqs (Llama 3 GGUF): each frequency divided by one
    # Llama 4's attention temperature (Ministral 3, Mistral 4): q times 1 + beta * log(1 + floor(position /
    # original_max_position_embeddings)), past the trained context only; 0: none
    llama4_scaling_beta: float = 0.0

    @classmethod
    def from_hf(cls, d: dict, hf: dict, source: str) -> "RopeConfig":
        """d: one layer kind's rope parameters; hf: the whole config.json (older keys live at its top level)."""
        rope_type = d.get("rope_type", d.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"{source}: rope type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
        theta = d.get("rope_theta", hf.get("rope_theta", 10000.0))
        if rope_type == "dynamic" and d.get("alpha"):  # Hunyuan's NTK alpha: a fixed, larger base, as HF's
            dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
            rope_type, theta = "default", theta * d["alpha"] ** (dim / (dim - 2))
        partial = d.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
        if partial is None:  # MiniMax-M2's configs give the rotated width instead
            dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
            partial = hf["rotary_dim"] / dim if hf.get("rotary_dim") else 1.0
        original = hf.get("original_max_position_embeddings") if rope_type in ("llama3", "yarn", "longrope") else None
        original = original or d.get("original_max_position_embeddings") or hf.get("max_position_embeddings", 2048)
        factor = d.get("factor")
        if factor is None:  # yarn and longrope infer it from the two context lengths
            factor = hf.get("max_position_embeddings", original) / original if rope_type in ("yarn", "longrope") \
                else 1.0
        if rope_type in ("linear", "dynamic", "llama3", "yarn") and "factor" not in d:
            raise ValueError(f"{source}: rope type {rope_type!r} needs a factor")
        attention = d.get("attention_factor")
        if rope_type == "longrope" and "short_mscale" in d:  # Phi-MoE's: cos and sin scaled as it says
            attention = d["short_mscale"]
            if d.get("long_mscale", attention) != attention:
                raise ValueError(f"{source}: longrope with short_mscale {attention} and long_mscale "
                                 f"{d['long_mscale']} is not supported (one scale at every length)")
        rope = cls(rope_type, float(theta), float(partial), float(factor), int(original),
                   float(d.get("low_freq_factor", 1.0)), float(d.get("high_freq_factor", 4.0)),
                   attention, float(d.get("beta_fast") or 32), float(d.get("beta_slow") or 1),
                   float(d.get("mscale") or 0), float(d.get("mscale_all_dim") or 0), bool(d.get("truncate", True)),
                   tuple(map(float, d.get("short_factor") or ())), tuple(map(float, d.get("long_factor") or ())),
                   tuple(map(float, d.get("freq_factors") or ())), float(d.get("llama_4_scaling_beta") or 0))
        if rope_type == "longrope" and not (rope.short_factor and rope.long_factor):
            raise ValueError(f"{source}: rope type 'longrope' needs short_factor and long_factor")
        return rope
