"""The flat batch of a step with drafts: a verify chunk's tokens and logits rows, and
on the CPU backends its attention as one decode row per token."""
from engine_core.worker_sampling import WorkerSamplingParams
from worker.input_batch import build_input_batch
from worker.request_state import CachedRequestState


def state(req_id, tokens, computed, blocks, drafts=()):
    s = CachedRequestState(req_id, list(tokens), 2, WorkerSamplingParams(), list(blocks),
                           computed, None)
    s.spec_token_ids = list(drafts)
    return s


def test_verify_chunk_tokens_logits_and_decode_rows():
    prefill = state("p", range(10, 16), 0, [7])  # 6 prompt tokens, block size 8
    verify = state("v", range(20, 30), 9, [3, 4], drafts=[91, 92])  # last token + 2
    decode = state("d", range(40, 45), 4, [5])
    batch = build_input_batch([prefill, verify, decode], [6, 3, 1], 8, None)
    # decodes and verify chunks first, then prefill chunks
    assert batch.input_ids.tolist() == [29, 91, 92, 44, 10, 11, 12, 13, 14, 15]
    assert batch.positions.tolist() == [9, 10, 11, 4, 0, 1, 2, 3, 4, 5]
    assert batch.attn.slot_mapping.tolist()[:4] == [4 * 8 + 1, 4 * 8 + 2, 4 * 8 + 3, 5 * 8 + 4]
    assert [s.req_id for s in batch.sampling_states] == ["v", "d", "p"]
    assert batch.logits_indices.tolist() == [0, 1, 2, 3, 9]  # k+1 rows for "v"
    # attention: the verify chunk is three decode rows over v's blocks
    assert batch.query_start_loc == [0, 1, 2, 3, 4, 10]
    assert batch.seq_lens == [10, 11, 12, 5, 6]
    assert batch.attn.plan.num_decodes == 4


def test_deterministic_mode_makes_every_token_a_decode_row():
    # worker.deterministic: prefill chunks too, one decode row per token over the
    # request's blocks, so each token's attention is computed as its decode would be
    import torch
    from worker.attention_backend import NATIVE_CPU, AttentionBackend
    backend = AttentionBackend(NATIVE_CPU, torch.device("cpu"), per_token_rows=True)
    prefill = state("p", range(10, 16), 2, [7])  # 4 tokens after a cached 2-token prefix
    decode = state("d", range(40, 45), 4, [5])
    batch = build_input_batch([prefill, decode], [4, 1], 8, None, backend)
    assert batch.input_ids.tolist() == [12, 13, 14, 15, 44]  # request order kept
    assert batch.query_start_loc == [0, 1, 2, 3, 4, 5]
    assert batch.seq_lens == [3, 4, 5, 6, 5]
    assert batch.request_start_loc == [0, 4, 5]
    plan = batch.attn.plan
    assert plan.num_decodes == 5 and not plan.prefills
    assert plan.decode_block_tables[:, 0].tolist() == [7, 7, 7, 7, 5]
    assert [s.req_id for s in batch.sampling_states] == ["p", "d"]
    assert batch.logits_indices.tolist() == [3, 4]
