"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM) over a flat ragged batch.

There is no batch dimension: ``input_ids`` and ``positions`` are ``[num_tokens]`` for
all requests of the step laid end to end, and attention finds each request's keys
through the paged KV cache (see kernels/paged_attention.py). q/k/v and gate/up
projections are fused into one matmul each.

Under tensor parallelism (``tp``) each rank builds the slice of the model its
:class:`ModelShard` names (worker/distributed/model_shard.py): its query and KV heads,
its MLP columns and its vocabulary rows. o_proj and down_proj then hold partial sums
that meet in one all-reduce each, the embedding in one more, and the LM head's
vocabulary slices are gathered on rank 0. Without ``tp`` there is no collective at all.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from kernels.paged_attention import PagedAttentionPlan, paged_attention
from kernels.reshape_and_cache import reshape_and_cache
from kernels.rms_norm import rms_norm
from kernels.rotary_embedding import rotary_embedding
from kernels.silu_and_mul import silu_and_mul
from worker.distributed.model_shard import ModelShard
from worker.heap import MMAP_THRESHOLD
from worker.models import prepacked
from worker.models.fused_decode import FusedDecode
from worker.models.architecture import ModelArchitecture
from worker.models.linear import (Linear, invariant_linear, k_major, linear,
                                  use_invariant_linears, use_k_major_weights, wants_k_major)
from worker.models.rotary_embedding import RotaryAngles, RotaryEmbedding

if TYPE_CHECKING:
    from worker.distributed.tp_group import TPGroup
    from worker.lora.lora_step import LoRALayer, LoRAStep


@dataclass(slots=True)
class AttentionContext:
    """What every attention layer needs for this step, passed down explicitly."""

    slot_mapping: torch.Tensor  # [num_tokens] cache slot of each new token
    plan: PagedAttentionPlan


class RMSNorm(nn.Module):
    """RMS normalisation computed in float32, optionally fused with the residual add
    (one Triton kernel on CUDA; see kernels/rms_norm.py)."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return rms_norm(x, self.weight, self.eps, residual)


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the embedding; a token outside them contributes zeros, and
    one all-reduce assembles every token's row (``weight`` keeps nn.Embedding's name)."""

    def __init__(self, shard: ModelShard, hidden_size: int, tp: TPGroup):
        super().__init__()
        self.tp = tp
        self.start, self.num_rows = shard.vocab_start, shard.vocab_per_rank
        self.weight = nn.Parameter(torch.empty(self.num_rows, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.num_rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill_(outside[:, None], 0))


class LlamaAttention(nn.Module):
    """Grouped-query self-attention with a fused qkv projection (this rank's heads)."""

    def __init__(self, arch: ModelArchitecture, shard: ModelShard, tp: TPGroup | None):
        super().__init__()
        self.tp = tp
        self.num_heads = shard.num_heads
        self.num_kv_heads = shard.num_kv_heads
        self.head_dim = arch.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(arch.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=arch.attention_bias)
        self.o_proj = Linear(self.q_size, arch.hidden_size, bias=False)
        self.scale = self.head_dim ** -0.5

    def forward(self, angles: RotaryAngles, hidden, kv_cache, ctx: AttentionContext,
                lora: LoRALayer | None = None):
        qkv = self.qkv_proj(hidden)
        if lora is not None:
            lora.add("qkv_proj", hidden, qkv)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = rotary_embedding(q, k, angles.cos, angles.sin)
        reshape_and_cache(k, v, kv_cache, ctx.slot_mapping)
        out = paged_attention(q, k, v, kv_cache, ctx.plan, self.scale).reshape(-1, self.q_size)
        y = self.o_proj(out)
        if lora is not None:
            lora.add("o_proj", out, y)
        return y if self.tp is None else self.tp.all_reduce(y)


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward with a fused gate/up projection (this rank's columns)."""

    def __init__(self, arch: ModelArchitecture, shard: ModelShard, tp: TPGroup | None):
        super().__init__()
        self.tp = tp
        self.intermediate_size = shard.intermediate_size
        self.gate_up_proj = Linear(arch.hidden_size, 2 * self.intermediate_size, bias=False)
        self.down_proj = Linear(self.intermediate_size, arch.hidden_size, bias=False)

    def forward(self, x, lora: LoRALayer | None = None):
        rows = mlp_chunk_rows(x, 2 * self.intermediate_size)
        if lora is None and rows < x.shape[0]:
            y = torch.cat([self._swiglu(x[i:i + rows]) for i in range(0, x.shape[0], rows)])
        else:
            y = self._swiglu(x, lora)
        return y if self.tp is None else self.tp.all_reduce(y)

    def _swiglu(self, x, lora: LoRALayer | None = None):
        gate_up = self.gate_up_proj(x)
        if lora is not None:
            lora.add("gate_up_proj", x, gate_up)
        h = silu_and_mul(gate_up)
        y = self.down_proj(h)
        if lora is not None:
            lora.add("down_proj", h, y)
        return y


def mlp_chunk_rows(x: torch.Tensor, gate_up_width: int) -> int:
    """Rows of ``x`` per MLP pass on a CPU: all of them, unless the gate/up output would
    reach the heap's mmap threshold (worker/heap.py). An allocation that large comes
    from a fresh mmap, and every one of its pages faults on first write: a 1B model's
    2,048-token prefill (a 46 MB gate/up output a layer) spent half its gate/up time on
    those faults in a VM (120-128 ms a layer against 53-63 once reused). Equal chunks
    under the threshold come from the heap and are reused layer after layer. A row's
    output does not depend on the others (bit for bit through oneDNN and torch at
    2,048 rows in 2 and 3 chunks), so the split changes no result."""
    row_bytes = gate_up_width * x.element_size()
    if x.device.type != "cpu" or x.shape[0] * row_bytes < MMAP_THRESHOLD:
        return x.shape[0]
    chunks = -(-x.shape[0] * row_bytes // (MMAP_THRESHOLD * 7 // 8))  # with headroom
    return -(-x.shape[0] // chunks)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention + MLP block; the residual stream is carried between layers."""

    def __init__(self, arch: ModelArchitecture, shard: ModelShard, tp: TPGroup | None):
        super().__init__()
        self.self_attn = LlamaAttention(arch, shard, tp)
        self.mlp = LlamaMLP(arch, shard, tp)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(self, angles, hidden, residual, kv_cache, ctx, lora=None):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(angles, hidden, kv_cache, ctx, lora)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden, lora), residual


class LlamaForCausalLM(nn.Module):
    """The whole model: embeddings, decoder layers, final norm and the LM head; with
    ``tp``, this rank's slice of it."""

    def __init__(self, arch: ModelArchitecture, max_positions: int,
                 tp: TPGroup | None = None):
        super().__init__()
        self.arch = arch
        self.tp = tp
        self.shard = shard = (ModelShard.whole(arch) if tp is None else
                              ModelShard.for_rank(arch, tp.rank, tp.size))
        self.embed_tokens = (nn.Embedding(arch.vocab_size, arch.hidden_size) if tp is None
                             else VocabParallelEmbedding(shard, arch.hidden_size, tp))
        self.rotary = RotaryEmbedding(arch.head_dim, max_positions, arch.rope_theta,
                                      arch.rope_scaling)
        self.layers = nn.ModuleList(LlamaDecoderLayer(arch, shard, tp)
                                    for _ in range(arch.num_hidden_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.lm_head = None if arch.tie_word_embeddings else Linear(
            arch.hidden_size, shard.vocab_per_rank, bias=False)
        # A tied head reads the embedding matrix, whose rows the lookup needs row-major;
        # prepare_for_cpu() may give the head its own K-major copy instead (or the
        # quantized embedding's packed blocks, worker/models/quant_linear.py).
        self.head_weight = None
        self.head_choice = None  # the head's measured LinearChoice (linear_backend.py)
        self.is_batch_invariant = False  # deterministic mode: make_batch_invariant()
        self.fused_decode: FusedDecode | None = None  # enable_fused_decode()

    def enable_fused_decode(self) -> bool:
        """Run decode-only steps through one native op per layer where the step allows
        (worker/models/fused_decode.py); call once the weights and linear choices are
        final. Returns whether this model can."""
        self.fused_decode = FusedDecode(self) if FusedDecode.supports(self) else None
        return self.fused_decode is not None

    def make_batch_invariant(self) -> None:
        """Deterministic mode: every projection and the LM head compute each row
        independently of the rows beside it (worker/models/linear.py). Norms, rotary,
        activations and the embedding already work row by row. The measured choices'
        oneDNN copies (worker/models/prepacked.py) go: these paths never read them."""
        use_invariant_linears(self)
        for weight in [*self.parameters(), self.head_weight]:
            prepacked.drop(weight)
        self.is_batch_invariant = True

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], ctx: AttentionContext,
                lora: LoRAStep | None = None) -> torch.Tensor:
        """Hidden states ``[num_tokens, hidden]`` after the final norm; ``lora``: the
        step's adapters (worker/lora/lora_step.py), None when no row has one."""
        hidden = self.embed_tokens(input_ids)
        angles = self.rotary(positions, hidden.dtype)
        fused = self.fused_decode
        if (lora is None and fused is not None
                and fused.takes(hidden.shape[0], hidden.dtype, kv_caches, ctx)):
            hidden, residual = fused.run(angles, hidden, kv_caches, ctx)
        else:
            residual = None
            for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
                hidden, residual = layer(angles, hidden, residual, kv_cache, ctx,
                                         lora.layer(i) if lora is not None else None)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor,
                       keep_dtype: bool = False) -> torch.Tensor | None:
        """Float32 logits ``[n, vocab]`` for the selected hidden states (``keep_dtype``:
        in the activation dtype, for a caller that only takes each row's argmax, which
        the exact widening to float32 would not change). With ``tp`` a collective: every
        rank computes its vocabulary slice, rank 0 gets them all and the others None."""
        weight = self.head_weight
        if weight is None:
            weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = (invariant_linear(hidden, weight) if self.is_batch_invariant
                  else linear(hidden, weight, None, self.head_choice))
        if not (keep_dtype and self.tp is None):
            logits = logits.float()
        if self.tp is None:
            return logits
        logits = self.tp.gather_last_dim(logits)
        return None if logits is None else logits[:, :self.arch.vocab_size]

    def prepare_for_cpu(self) -> bool:
        """Lay the linear weights out K-major where the CPU GEMM wants it
        (worker/models/linear.py; a tied head then gets a K-major copy of the
        embedding, one more vocab x hidden). Returns whether it did."""
        if not wants_k_major(self.norm.weight.dtype):
            return False
        use_k_major_weights(self)
        if self.lm_head is None and self.head_weight is None:
            self.head_weight = k_major(self.embed_tokens.weight)
        return True

    @torch.no_grad()
    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Copy Hugging Face-named weights in, fusing q/k/v and gate/up on the way (cut
        to this rank's slice first under tensor parallelism)."""
        state_dict = self.shard.shard_state_dict(state_dict, self.arch.head_dim)
        state_dict = dict(state_dict)  # entries are popped as they are placed
        params = dict(self.named_parameters())
        loaded = set()

        def put(name, tensor):
            if name not in params:
                raise KeyError(f"checkpoint tensor has no place in the model: {name}")
            if params[name].shape != tensor.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != "
                                 f"model shape {tuple(params[name].shape)}")
            params[name].copy_(tensor)
            loaded.add(name)

        for i in range(self.arch.num_hidden_layers):
            p = f"model.layers.{i}."
            for suffix in ("weight", "bias"):
                parts = [state_dict.pop(f"{p}self_attn.{n}_proj.{suffix}", None)
                         for n in "qkv"]
                if all(t is not None for t in parts):
                    put(f"layers.{i}.self_attn.qkv_proj.{suffix}", torch.cat(parts))
            parts = [state_dict.pop(f"{p}mlp.{n}_proj.weight", None) for n in ("gate", "up")]
            if all(t is not None for t in parts):  # absent: a quantized layer holds them
                put(f"layers.{i}.mlp.gate_up_proj.weight", torch.cat(parts))
        for name, tensor in state_dict.items():
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the embedding serves as the head
            put(name.removeprefix("model."), tensor)
        missing = set(params) - loaded
        if missing:
            raise ValueError(f"checkpoint lacks weights: {sorted(missing)[:5]}")
