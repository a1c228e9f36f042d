"""The draft model of speculative decoding (``speculative.method: draft_model``).

A second, smaller model with the target's tokenizer, loaded beside it in the worker,
proposes each request's k drafts at the start of the step that verifies them.

Its paged KV cache has the target pool's geometry and block ids: a request's block
table addresses both caches, so every slot the scheduler grants the target (drafts
included) exists for the draft too. ``num_draft_computed`` says how far a request's
draft K/V is valid. Proposing for a request with N known tokens::

    pass 1      tokens num_draft_computed .. N-1 (catch-up: at least the last token)
                → d1 from the logits at N-1
    pass j>1    d_{j-1} at position N+j-2 → d_j          (one decode step per draft)

after which draft K/V holds d1..d_{k-1} at N..N+k-2. Once the target accepted a of
the k drafts, positions below N + min(a, k-1) hold K/V of true tokens:
``on_verified`` sets ``num_draft_computed`` there, and the next catch-up overwrites
the rest. A request the runner sees anew (new, resumed, forked) starts from 0, so the
draft cache never needs copies, and shared prefix blocks are only ever rewritten with
the same values. Blocks the scheduler drops hold only positions >= N + a.
A constrained request drafts only what its grammar allows (structured_output/
draft_guide.py).
"""
from __future__ import annotations

import torch

from model_files.paths import ModelFileError
from text.tokenizer import Tokenizer
from worker.attention_backend import make_attention_backend
from worker.input_batch import build_input_batch
from worker.kv_cache import KVCacheSpec, allocate_kv_cache
from worker.loader import load_model
from worker.models.architecture import ModelArchitecture
from worker.models.registry import build_model
from worker.request_state import CachedRequestState
from worker.structured_output.draft_guide import DraftGuide

_MIX = 0x9E3779B97F4A7C15  # spreads (seed, position) over generator seeds


class DraftRunner:
    """Loads the draft model and proposes drafts for the requests of a step."""

    def __init__(self, path: str, target_arch: ModelArchitecture, dtype: torch.dtype,
                 device: torch.device, attention_backend: str, block_size: int,
                 max_model_len: int, k_major_weights: bool,
                 kv_cache_dtype: torch.dtype | None = None):
        loaded = load_model(path, dtype)
        self.arch = arch = loaded.architecture
        if arch.vocab_size != target_arch.vocab_size:
            raise ValueError(f"speculative.draft_model: its vocabulary has {arch.vocab_size} "
                             f"tokens, the model's {target_arch.vocab_size}")
        if arch.max_position_embeddings < max_model_len:
            raise ValueError(f"speculative.draft_model: {arch.max_position_embeddings} "
                             f"positions, fewer than max_model_len={max_model_len}")
        self.model = build_model(arch, max_model_len + 1)
        self.model.load_weights(loaded.state_dict)
        self.model.to(device=device, dtype=dtype).eval()
        if device.type == "cpu" and k_major_weights:
            self.model.prepare_for_cpu()
        self.backend = make_attention_backend(attention_backend, device,
                                              arch.num_key_value_heads)
        # the target's KV dtype (memory.kv_cache_dtype), so both pools shrink together
        self.kv_spec = KVCacheSpec.for_model(arch, block_size, kv_cache_dtype or dtype)
        self.block_size, self.device = block_size, device
        self.kv_caches: list[torch.Tensor] = []

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """The draft's pool: as many blocks as the target's, addressed by the same ids."""
        self.kv_caches = allocate_kv_cache(self.kv_spec, num_blocks, self.device)

    @torch.inference_mode()
    def propose(self, states: list[CachedRequestState],
                num_drafts: list[int]) -> dict[str, torch.Tensor]:
        """Set each state's ``spec_token_ids`` to its drafts; returns, per request that
        sampled its drafts (temperature > 0), the draft distributions ``[k, vocab]``."""
        drafts: list[list[int]] = [[] for _ in states]
        probs: list[list[torch.Tensor]] = [[] for _ in states]
        guide = DraftGuide(states, self.arch.vocab_size)  # constrained: grammar-guided
        for j in range(max(num_drafts, default=0)):
            active = [i for i, k in enumerate(num_drafts) if k > j]
            views = [self._view(states[i], drafts[i], j) for i in active]
            logits = self._forward(views)
            guide.mask(logits, active)
            positions = [len(states[i].token_ids) + j for i in active]
            tokens, q = self._sample(logits, [states[i] for i in active], positions)
            for row, i in enumerate(active):
                drafts[i].append(tokens[row])
                guide.advance(i, tokens[row])
                if q is not None:
                    probs[i].append(q[row])
        guide.finish()
        for state, d in zip(states, drafts):
            state.spec_token_ids = d
        return {s.req_id: torch.stack(p) for s, p in zip(states, probs)
                if p and s.sampling_params.temperature > 0}

    @staticmethod
    def _view(state: CachedRequestState, drafts: list[int], j: int) -> CachedRequestState:
        """Pass j's input: the catch-up chunk (j = 0) or draft j at N + j - 1."""
        n = len(state.token_ids)
        return CachedRequestState(
            req_id=state.req_id, token_ids=state.token_ids + drafts[:j] if j else state.token_ids,
            num_prompt_tokens=state.num_prompt_tokens, sampling_params=state.sampling_params,
            block_ids=state.block_ids, generator=None,
            num_computed_tokens=state.num_draft_computed if j == 0 else n + j - 1)

    def _forward(self, views: list[CachedRequestState]) -> torch.Tensor:
        """Float32 logits at each view's last token, in ``views`` order."""
        counts = [v.num_tokens_with_spec - v.num_computed_tokens for v in views]
        batch = build_input_batch(views, counts, self.block_size, self.arch.sliding_window,
                                  self.backend)
        hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.attn)
        logits = self.model.compute_logits(hidden[batch.logits_indices]).cpu()
        order = {id(v): row for row, v in enumerate(batch.sampling_states)}
        return logits[[order[id(v)] for v in views]]

    @staticmethod
    def _sample(logits: torch.Tensor, states: list[CachedRequestState],
                positions: list[int]) -> tuple[list[int], torch.Tensor | None]:
        """Greedy drafts for greedy requests; the others draw from q = softmax(logits /
        temperature), seeded ones with noise keyed by (seed, position)."""
        temps = torch.tensor([s.sampling_params.temperature for s in states])
        greedy = logits.argmax(-1)
        if not bool((temps > 0).any()):
            return greedy.tolist(), None
        q = (logits / torch.where(temps > 0, temps, 1.0)[:, None]).softmax(-1)
        noise = torch.empty_like(q).exponential_()
        for row, (s, pos) in enumerate(zip(states, positions)):
            if s.sampling_params.seed is not None:
                gen = torch.Generator().manual_seed((s.sampling_params.seed * _MIX + pos)
                                                    % 2 ** 63)
                noise[row].exponential_(generator=gen)
        tokens = torch.where(temps > 0, (q / noise).argmax(-1), greedy)
        return tokens.tolist(), q

    @staticmethod
    def on_verified(state: CachedRequestState, num_drafts: int, num_emitted: int) -> None:
        """After verification (``num_emitted`` tokens appended): draft K/V is valid for
        N + min(accepted, k - 1) positions, N the known tokens before the step."""
        if num_drafts:
            num_known = len(state.token_ids) - num_emitted
            state.num_draft_computed = num_known + min(num_emitted - 1, num_drafts - 1)


def draft_probs_rows(states: list[CachedRequestState], num_drafts: list[int],
                     probs: dict[str, torch.Tensor], vocab_size: int) -> torch.Tensor | None:
    """The draft distributions laid out as the target's rows (k+1 per request, the
    bonus row zero), or None when no request sampled its drafts."""
    if not probs:
        return None
    rows = torch.zeros(sum(k + 1 for k in num_drafts), vocab_size)
    row = 0
    for state, k in zip(states, num_drafts):
        if state.req_id in probs:
            rows[row:row + k] = probs[state.req_id]
        row += k + 1
    return rows


def check_draft_tokenizer(tokenizer: Tokenizer, draft_path: str) -> None:
    """Start-up check: the draft's tokenizer must be the model's (every token id must
    mean the same text), else its drafts would be nonsense to the model."""
    try:
        draft = Tokenizer.from_model_path(draft_path)
    except (ModelFileError, OSError) as e:
        raise ValueError(f"speculative.draft_model: cannot read its tokenizer ({e}); the "
                         f"draft must come with the model's tokenizer") from None
    if (draft.backend.get_vocab(with_added_tokens=True)
            != tokenizer.backend.get_vocab(with_added_tokens=True)):
        raise ValueError(f"speculative.draft_model: the tokenizer of {draft_path} differs "
                         f"from the model's; a draft must share the model's tokenizer")
