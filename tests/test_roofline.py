"""`pipellm bench --roofline`'s model arithmetic, against the weights HF transformers' own modules hold."""
import pytest
from torch import nn

from pipellm.model_config import ModelConfig
from pipellm.observe.roofline import _context_sum, _linear_params


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_weights_a_token_passes_equal_hfs_linear_layers(checkpoints, arch):
    folder, hf_model = checkpoints[arch]
    cfg = ModelConfig.from_pretrained(folder)
    blocks = hf_model.transformer.h if arch == "gpt2" else hf_model.model.layers
    for i, block in enumerate(blocks):
        linears = [m for m in block.modules() if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"]
        assert _linear_params(cfg, i) == sum(m.weight.numel() for m in linears)


def test_keys_attended_count_every_token_once(checkpoints):
    cfg = ModelConfig.from_pretrained(checkpoints["mistral"][0])  # a window of 24
    requests = [(30, 5), (3, 1)]
    full = sum(p + 1 for prompt, new in requests for p in range(prompt + new - 1))
    windowed = sum(min(p + 1, 24) for prompt, new in requests for p in range(prompt + new - 1))
    assert _context_sum(cfg, 0, requests) == windowed < full
