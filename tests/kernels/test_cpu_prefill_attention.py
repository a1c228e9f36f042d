"""The native prefill kernel (``csrc/prefill_attention.cpp``: AMX tiles, or AVX512-BF16
dot products where the CPU has no AMX) against float32 maths and the torch reference, and
the native plan's routing of fresh prompt segments to it.

It runs only where the extension is built with AVX512-BF16; elsewhere these tests skip
(and the SDPA reference runs). On an AMX CPU they test the tiles, on others the dot
products."""
import os

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_paged_attention as cpa
from kernels.paged_attention import make_plan, paged_attention, paged_attention_reference
from tests.kernels.ragged_case import make_case

if os.environ.get(cpa.DISABLE_ENV, "").strip().lower() not in ("", "0", "false", "no"):
    pytest.skip(f"{cpa.DISABLE_ENV} is set", allow_module_level=True)
if not cpa.prefill_attention_available():
    pytest.skip("no AVX512-BF16 here: the prefill kernel is not built",
                allow_module_level=True)

EPS = torch.finfo(torch.bfloat16).eps


def fused_step(lens, num_heads, num_kv_heads, head_dim, seed=0):
    """q/k/v as strided views of one fused projection, as the model slices them."""
    gen = torch.Generator().manual_seed(seed)
    T = sum(lens)
    qkv = (torch.randn(T, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen) * 2
           ).to(torch.bfloat16)
    q = qkv[:, :num_heads * head_dim].view(T, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim:(num_heads + num_kv_heads) * head_dim].view(
        T, num_kv_heads, head_dim)
    v = qkv[:, (num_heads + num_kv_heads) * head_dim:].view(T, num_kv_heads, head_dim)
    starts = torch.tensor([sum(lens[:i]) for i in range(len(lens))], dtype=torch.int64)
    return q, k, v, starts, torch.tensor(lens, dtype=torch.int64)


def causal_float32(q, k, v, starts, lens, scale):
    out = torch.zeros(q.shape, dtype=torch.float32)
    for s, n in zip(starts.tolist(), lens.tolist()):
        out[s:s + n] = F.scaled_dot_product_attention(
            q[s:s + n].float().transpose(0, 1)[None], k[s:s + n].float().transpose(0, 1)[None],
            v[s:s + n].float().transpose(0, 1)[None], is_causal=True, scale=scale,
            enable_gqa=True)[0].transpose(0, 1)
    return out


@pytest.mark.parametrize("num_kv_heads,group", [(3, 3), (2, 1), (1, 8)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_matches_float32_maths(head_dim, num_kv_heads, group):
    # lengths around the kernel's 16-token tiles and 32-key blocks, and a long one
    lens = [1, 2, 15, 16, 17, 31, 32, 33, 47, 100, 257]
    q, k, v, starts, seg_lens = fused_step(lens, num_kv_heads * group, num_kv_heads, head_dim)
    scale = head_dim ** -0.5
    out = torch.full(q.shape, 7.0, dtype=torch.bfloat16)
    cpa.prefill_attention(q, k, v, starts, seg_lens, scale, out)
    ref = causal_float32(q, k, v, starts, seg_lens, scale)
    # The probabilities are rounded to bf16 for P V (as torch's flash attention does),
    # then the output: within a few bf16 steps of exact maths on the same inputs.
    torch.testing.assert_close(out.float(), ref, atol=4 * EPS, rtol=2 * EPS)


def test_probabilities_carry_sixteen_bits_into_p_v():
    # p goes into P V as two bf16 parts (hi + lo): the outputs are float32 attention
    # rounded to bf16 nearly always, where one bf16 part (torch's SDPA) gets ~80%
    lens = [100, 257]
    q, k, v, starts, seg_lens = fused_step(lens, 9, 3, 64, seed=3)
    out = torch.empty_like(q)
    cpa.prefill_attention(q, k, v, starts, seg_lens, 0.125, out)
    ref = causal_float32(q, k, v, starts, seg_lens, 0.125)
    assert (out == ref.to(torch.bfloat16)).float().mean() > 0.99


def test_writes_only_the_segments_rows():
    lens = [20, 40]
    q, k, v, _, _ = fused_step([5] + lens + [7], 9, 3, 64)
    starts = torch.tensor([5, 25], dtype=torch.int64)
    out = torch.full(q.shape, 7.0, dtype=torch.bfloat16)
    cpa.prefill_attention(q, k, v, starts, torch.tensor(lens), 0.125, out)
    assert torch.all(out[:5] == 7.0) and torch.all(out[65:] == 7.0)
    ref = causal_float32(q, k, v, starts, torch.tensor(lens), 0.125)
    torch.testing.assert_close(out[5:65].float(), ref[5:65], atol=4 * EPS, rtol=2 * EPS)


def test_same_result_for_any_thread_count_and_batch():
    lens = [33, 80, 17]
    q, k, v, starts, seg_lens = fused_step(lens, 9, 3, 64)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = torch.empty_like(q)
        cpa.prefill_attention(q, k, v, starts, seg_lens, 0.125, one)
        torch.set_num_threads(2)
        many = torch.empty_like(q)
        cpa.prefill_attention(q, k, v, starts, seg_lens, 0.125, many)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, many)
    alone = torch.empty_like(q)  # a segment's rows do not depend on the others
    cpa.prefill_attention(q, k, v, starts[1:2], seg_lens[1:2], 0.125, alone)
    assert torch.equal(alone[33:113], one[33:113])


def test_rejects_bad_input():
    q, k, v, starts, seg_lens = fused_step([10], 9, 3, 64)
    out = torch.empty_like(q)
    with pytest.raises(RuntimeError, match="outside the step"):
        cpa.prefill_attention(q, k, v, torch.tensor([5]), torch.tensor([10]), 0.125, out)
    with pytest.raises(RuntimeError, match="bf16"):
        cpa.prefill_attention(q.float(), k.float(), v.float(), starts, seg_lens, 0.125,
                              out.float())
    with pytest.raises(RuntimeError, match="head_dim"):
        cpa.prefill_attention(q[..., :32], k[..., :32], v[..., :32], starts, seg_lens, 0.125,
                              out[..., :32])


def test_native_plan_routes_fresh_segments_and_matches_the_reference(monkeypatch):
    # decodes, fresh prompts (the kernel) and a continued prompt (SDPA over cached keys)
    case = make_case([(40, 1), (0, 1), (0, 37), (0, 16), (24, 9), (0, 70)], block_size=16,
                     num_heads=9, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16)
    plan = make_plan(case.query_start_loc, case.seq_lens, case.block_tables, 16,
                     use_native_decode=True, native_prefill=True)
    calls = []
    real = cpa.prefill_attention
    monkeypatch.setattr(cpa, "prefill_attention",
                        lambda q, k, v, starts, lens, *a: calls.append(lens.tolist())
                        or real(q, k, v, starts, lens, *a))
    out = paged_attention(case.query, case.key, case.value, case.kv_cache, plan, 0.125)
    assert calls == [[37, 16, 70]]  # one call, the fresh segments only
    ref = case.reference(0.125, None)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    # a prefill-only step (no decodes) takes the kernel too
    only = make_case([(0, 20), (0, 33)], block_size=16, num_heads=9, num_kv_heads=3,
                     head_dim=64, dtype=torch.bfloat16, seed=1)
    plan = make_plan(only.query_start_loc, only.seq_lens, only.block_tables, 16,
                     use_native_decode=True, native_prefill=True)
    calls.clear()
    out = paged_attention(only.query, only.key, only.value, only.kv_cache, plan, 0.125)
    assert calls == [[20, 33]]
    torch.testing.assert_close(out.float(), only.reference(0.125, None).float(), atol=2e-2,
                               rtol=2e-2)


@pytest.mark.parametrize("native", [False, True], ids=["torch", "native-sdpa"])
def test_without_native_prefill_prompts_take_sdpa(monkeypatch, native):
    # the torch backend, and the native one under the default worker.prefill_attention
    case = make_case([(0, 20), (0, 9)], block_size=16, num_heads=9, num_kv_heads=3,
                     head_dim=64, dtype=torch.bfloat16)
    plan = make_plan(case.query_start_loc, case.seq_lens, case.block_tables, 16,
                     use_native_decode=native)
    monkeypatch.setattr(cpa, "prefill_attention",
                        lambda *a: pytest.fail("only native_prefill plans take the kernel"))
    out = paged_attention(case.query, case.key, case.value, case.kv_cache, plan, 0.125)
    assert torch.equal(out, paged_attention_reference(case.query, case.key, case.value,
                                                      case.kv_cache, plan, 0.125))


def test_worker_config_turns_it_on():
    from folio import LLM
    from engine_core.sampling_params import SamplingParams
    prompts = [{"prompt_token_ids": [100 + (7 * i) % 900 for i in range(n)]} for n in (40, 75)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    runs = {}
    for choice in ("sdpa", "native", "amx"):  # amx: native's older name
        llm = LLM(model="default", dtype="bfloat16", max_model_len=256, num_blocks=64,
                  **{"worker.prefill_attention": choice, "observability.log_level": "warning"})
        assert llm.runner.attention_backend.native_prefill == (choice != "sdpa")
        runs[choice] = [o.outputs[0].token_ids for o in llm.generate(prompts, params,
                                                                     use_tqdm=False)]
        del llm
    assert all(len(t) == 4 for t in runs["native"])
