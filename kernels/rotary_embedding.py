"""Rotary position embedding applied to queries and keys together (rotate-half layout).

With ``cos``/``sin`` the step's angles ``[T, 1, head_dim / 2]`` (looked up once per step
and shared by every layer) and each head split in halves ``x = [x1 | x2]``::

    rotate(x) = [x1 * cos - x2 * sin | x2 * cos + x1 * sin]

On a GPU the torch version is about ten small kernels per layer (chunk, four products,
add, subtract, concatenate, for q and for k); the Triton kernel rotates every head of
one token's q and k in one program, in float32, rounding once. On the CPU the native
kernel (``csrc/rotary_embedding.cpp``) makes one pass with the reference's rounding
points, so its bits are the reference's.
"""
from __future__ import annotations

import torch

from kernels import cpu_extension


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)


def rotary_embedding_reference(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor,
                               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The spec: ``query`` ``[T, H, hd]`` and ``key`` ``[T, kvh, hd]`` rotated."""
    return _rotate(query, cos, sin), _rotate(key, cos, sin)


def rotary_embedding(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``query`` and ``key``: CUDA takes the Triton kernel, the CPU the native one
    when it is built and the operands are laid out as a step's are (each token's heads
    contiguous, one dtype), else the reference."""
    if query.is_cuda:  # Triton is loaded by the GPU path only
        from kernels.triton_rotary_embedding import rotary_embedding_triton
        return rotary_embedding_triton(query, key, cos, sin)
    if _native_takes(query, key, cos, sin) and cpu_extension.is_available():
        return cpu_extension.require().rotary_embedding(query, key, cos, sin)
    return rotary_embedding_reference(query, key, cos, sin)


def _native_takes(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor) -> bool:
    def heads_contiguous(x: torch.Tensor) -> bool:
        return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.size(2)
    return (heads_contiguous(query) and heads_contiguous(key) and cos.dim() == 3
            and cos.size(1) == 1 and cos.stride(2) == 1 and sin.stride() == cos.stride()
            and query.dtype == key.dtype == cos.dtype == sin.dtype
            and query.dtype in (torch.float32, torch.bfloat16, torch.float16))
