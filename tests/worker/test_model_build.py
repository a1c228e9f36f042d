"""build_model leaves the parameters uninitialised (the checkpoint fills every one), and
nn.Linear / nn.Embedding initialise as usual everywhere else, before and after."""
import torch
from torch import nn

from worker.models.architecture import ModelArchitecture
from worker.models.registry import build_model

ARCH = ModelArchitecture(architecture="llama", vocab_size=128, hidden_size=32,
                         intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                         rms_norm_eps=1e-6, tie_word_embeddings=False)


def test_build_model_runs_no_random_init_and_leaves_init_working(monkeypatch):
    calls = []
    for name in ("kaiming_uniform_", "uniform_", "normal_"):
        original = getattr(nn.init, name)
        monkeypatch.setattr(nn.init, name,
                            lambda *a, _f=original, _n=name, **k: (calls.append(_n),
                                                                  _f(*a, **k))[1])
    model = build_model(ARCH, 64)
    assert calls == []
    assert model.lm_head.weight.shape == (128, 32)  # the parameters exist, with shapes
    assert model.embed_tokens.weight.shape == (128, 32)
    torch.manual_seed(0)
    layer, embedding = nn.Linear(8, 4), nn.Embedding(16, 4)
    assert "kaiming_uniform_" in calls and "normal_" in calls
    torch.manual_seed(0)
    assert torch.equal(layer.weight, nn.Linear(8, 4).weight)
    assert embedding.weight.abs().sum() > 0
