"""`pipellm bench --roofline`'s model arithmetic, against the weights HF transformers' own modules hold."""
import pytest
from torch import nn

from pipellm.model_config import ModelConfig
from pipellm.observe.roofline import _context_sum


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_weights_a_token_passes_equal_hfs_linear_layers(checkpoints, arch):
    folder, hf_model = checkpoints[arch]
    cfg = ModelConfig.from_pretrained(folder)
    blocks = hf_model.transformer.h if arch == "gpt2" else hf_model.model.layers
    for i, block in enumerate(blocks):
        linears = [m for m in block.modules() if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"]
        assert cfg.layer_weights(i, picked=True) == sum(m.weight.numel() for m in linears)


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_5_moe", "granitemoehybrid", "nemotron_h", "nemotron_h-latent",
                                  "nemotron_h-dense", "falcon_h1", "jamba", "lfm2", "lfm2_moe", "bamba", "gpt_oss",
                                  "apertus"])
def test_layer_weights_equal_hfs_matrices(tmp_path, name):
    """Each layer's matmul weights (every expert's; what a stage's GPU memory is planned with) equal the matrices
    HF's layer holds, its convolutions, (stacked) biases and Mamba's A aside: linear-attention, Mamba, Mamba-2 and
    MLP-only layers, short convolutions, ungated MLPs and experts, gated shared experts."""
    from tests.test_families import make_family_checkpoint

    hf_model = make_family_checkpoint(name, str(tmp_path))
    cfg = ModelConfig.from_pretrained(str(tmp_path))
    for i, block in enumerate(hf_model.model.layers):
        matrices = [p for n, p in block.named_parameters()
                    if p.dim() >= 2 and not any(k in n for k in ("conv1d", "conv.conv", "bias", "A_log"))]
        assert cfg.layer_weights(i) == sum(p.numel() for p in matrices), i


def test_keys_attended_count_every_token_once(checkpoints):
    cfg = ModelConfig.from_pretrained(checkpoints["mistral"][0])  # a window of 24
    requests = [(30, 5), (3, 1)]
    full = sum(p + 1 for prompt, new in requests for p in range(prompt + new - 1))
    windowed = sum(min(p + 1, 24) for prompt, new in requests for p in range(prompt + new - 1))
    assert _context_sum(cfg, 0, requests) == windowed < full
