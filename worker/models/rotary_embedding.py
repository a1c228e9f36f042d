"""Rotary position embedding (the rotate-half layout Hugging Face Llama uses)."""
from __future__ import annotations

import math

import torch

from worker.models.architecture import RopeScaling


def _inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is None or scaling.rope_type != "llama3":
        return inv_freq
    # Llama 3: long wavelengths are slowed by `factor`, short ones kept, and the band
    # between the two cut-offs is interpolated smoothly.
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos/sin tables indexed by absolute position.

    ``cos_sin`` is ``[max_positions, head_dim]``: the first half cosines, the second
    half sines, of the ``head_dim / 2`` frequencies.
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: RopeScaling | None = None):
        super().__init__()
        self.head_dim = head_dim
        inv_freq = _inverse_frequencies(head_dim, theta, scaling).float()
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        self.register_buffer("cos_sin", torch.cat([freqs.cos(), freqs.sin()], dim=-1),
                             persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> "RotaryAngles":
        """The step's cos/sin rows, looked up once and shared by every layer."""
        cos, sin = self.cos_sin.index_select(0, positions).to(dtype).unsqueeze(1).chunk(2, -1)
        return RotaryAngles(cos, sin)


class RotaryAngles:
    """cos/sin ``[T, 1, head_dim / 2]`` for one step's positions; the rotation itself is
    kernels.rotary_embedding.rotary_embedding (q and k together)."""

    __slots__ = ("cos", "sin")

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor):
        self.cos, self.sin = cos, sin
