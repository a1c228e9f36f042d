"""New weights into a running model, checked in full before anything changes.

    source (safetensors file or folder, or a state dict)
      ─▶ read_update_weights: Hugging Face names, as the checkpoint loader reads them
      ─▶ plan_weight_update: every name and shape checked against the running model;
         each tensor paired with the place it goes (a slice of a fused parameter)
      ─▶ apply_weight_update: copied in place, between steps

Names are the Hugging Face Llama layout the loaders produce (worker/weight_names.py):
``q/k/v_proj`` land in their rows of the fused ``qkv_proj``, ``gate/up_proj`` in theirs
of ``gate_up_proj``; ``lm_head.weight`` of a model with tied embeddings is dropped, as
the loader drops it. An update may hold any subset of the weights. Copying into the
existing parameters keeps the layout the loader chose (K-major on the CPU, see
worker/models/linear.py) and the addresses captured CUDA graphs read; a tied head's
own copy (``head_weight``) is refreshed from the embedding afterwards.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from model_files.paths import ModelFileError
from worker.hf_loader import IGNORED_SUFFIXES, read_safetensors, safetensors_files
from worker.models.architecture import ModelArchitecture
from worker.weight_names import expected_weight_shapes

# HF projection → (fused parameter, index of its part among the fused ones)
_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


class WeightUpdateError(ValueError):
    """An update refused before any weight changed; ``tensor`` names the bad one."""

    def __init__(self, message: str, tensor: str | None = None):
        super().__init__(message)
        self.tensor = tensor


@dataclass(slots=True)
class WeightCopy:
    """One checked tensor and the (view of a) parameter it replaces."""

    name: str
    target: torch.Tensor
    source: torch.Tensor


def read_update_weights(source: str | Path | Mapping[str, torch.Tensor]
                        ) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file, of every safetensors file of a folder (a
    sharded index's files), or of a state dict; exporters' extra buffers skipped."""
    if isinstance(source, Mapping):
        tensors = dict(source)
    else:
        path = Path(source)
        try:
            if path.is_dir():
                files = safetensors_files(path)
            elif path.is_file():
                files = [path]
            else:
                raise WeightUpdateError(f"no such file or folder: {path}", None)
            tensors = {}
            for file in files:
                tensors.update(read_safetensors(file))
        except ModelFileError as e:
            raise WeightUpdateError(str(e)) from None
    return {n: t for n, t in tensors.items() if not n.endswith(IGNORED_SUFFIXES)}


def _fused_rows(arch: ModelArchitecture, fused: str, part: int) -> slice:
    if fused == "qkv_proj":
        q, kv = arch.num_attention_heads * arch.head_dim, arch.num_key_value_heads * arch.head_dim
        starts = (0, q, q + kv)
        return slice(starts[part], starts[part] + (q if part == 0 else kv))
    inter = arch.intermediate_size
    return slice(part * inter, (part + 1) * inter)


def _target(params: dict[str, nn.Parameter], arch: ModelArchitecture,
            name: str) -> torch.Tensor:
    """The parameter (or rows of a fused one) that HF tensor ``name`` fills."""
    parts = name.removeprefix("model.").split(".")
    proj = parts[-2] if len(parts) >= 2 else ""
    if proj in _FUSED:
        fused, part = _FUSED[proj]
        param = params[".".join(parts[:-2] + [fused, parts[-1]])]
        return param[_fused_rows(arch, fused, part)]
    return params[".".join(parts)]


def plan_weight_update(tensors: Mapping[str, torch.Tensor], arch: ModelArchitecture,
                       model: nn.Module) -> list[WeightCopy]:
    """Check every tensor (name, shape, a floating dtype, finite values) and pair it
    with its place; WeightUpdateError naming the first bad one, nothing changed."""
    expected = expected_weight_shapes(arch)
    params = dict(model.named_parameters())
    plan = []
    for name, tensor in tensors.items():
        if name == "lm_head.weight" and arch.tie_word_embeddings:
            continue  # tied: the embedding is the head (the loader drops it too)
        if name not in expected:
            raise WeightUpdateError(f"{name}: the running {arch.architecture} model has no "
                                    f"such weight", name)
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
            raise WeightUpdateError(f"{name}: expected a floating-point tensor", name)
        if tuple(tensor.shape) != expected[name]:
            raise WeightUpdateError(f"{name}: shape {tuple(tensor.shape)}, the running "
                                    f"model's is {expected[name]}", name)
        if not bool(torch.isfinite(tensor).all()):
            raise WeightUpdateError(f"{name}: holds NaN or infinite values", name)
        plan.append(WeightCopy(name, _target(params, arch, name), tensor))
    if not plan:
        raise WeightUpdateError("the update holds no weight of this model")
    return plan


@torch.no_grad()
def apply_weight_update(model: nn.Module, plan: list[WeightCopy]) -> None:
    """Copy each checked tensor into its place (cast to the model's dtype and device)."""
    for copy in plan:
        copy.target.copy_(copy.source)
    head = getattr(model, "head_weight", None)
    if head is not None:  # a tied head's own (K-major) copy of the embedding
        head.copy_(model.embed_tokens.weight)
