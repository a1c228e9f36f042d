"""The worker's GPU path, checked on the CPU.

The Triton backend runs in Triton's interpreter (TRITON_INTERPRET=1, tests/conftest.py):
the runner builds the same device metadata it builds on CUDA, and the model calls the
same kernels. CUDA-graph padding is checked by running, eagerly, exactly the forward
pass a graph captures. Pure helpers (backend choice, graph ladder, KV budget) get plain
unit tests.
"""
import random

import pytest
import torch

from engine_core.sampling_params import SamplingParams
from engine_core.worker_sampling import WorkerSamplingParams
from worker.attention_backend import (NATIVE_CPU, TORCH, TRITON, AttentionBackend,
                                      choose_attention_backend)
from worker.cuda_graphs import DecodeCudaGraphs, capture_sizes, padded_size
from worker.gpu_memory import kv_cache_budget, profile_prompt_lengths
from worker.input_batch import build_input_batch
from worker.request_state import CachedRequestState

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-side checks")


def test_choose_attention_backend(monkeypatch):
    always = lambda: True  # noqa: E731
    assert choose_attention_backend("auto", CUDA, always) == TRITON
    assert choose_attention_backend("auto", CPU, always) == NATIVE_CPU
    assert choose_attention_backend("auto", CPU, lambda: False) == TORCH
    assert choose_attention_backend("torch", CUDA, always) == TORCH
    assert choose_attention_backend("triton", CUDA) == TRITON
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        choose_attention_backend("triton", CPU)

    def must_not_build():
        raise AssertionError("the native kernel must not be built for CUDA")
    assert choose_attention_backend("auto", CUDA, must_not_build) == TRITON


def test_capture_sizes_and_padding():
    assert capture_sizes(1) == [1]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    ladder = capture_sizes(256)
    assert ladder[:5] == [1, 2, 4, 8, 16] and ladder[-1] == 256 and len(ladder) == 20
    assert capture_sizes(10_000)[-1] == 512
    assert [padded_size(n, ladder) for n in (1, 3, 5, 9, 17, 255, 256)] == \
        [1, 4, 8, 16, 32, 256, 256]
    assert padded_size(257, ladder) is None
    for n in range(1, 257):  # padding never wastes more than 15 rows past 8
        assert padded_size(n, ladder) - n < max(n, 16)


def test_kv_cache_budget_arithmetic():
    gib = 2 ** 30
    # 141 GiB GPU at 0.9: 126.9 GiB, minus a 3 GiB peak step and 0.5 GiB outside torch
    assert kv_cache_budget(141 * gib, 0.9, 3 * gib, gib // 2) == int(141 * gib * 0.9) \
        - 3 * gib - gib // 2
    assert kv_cache_budget(8 * gib, 0.5, 5 * gib, 0) == 0  # the model alone is too big
    # CUDA graphs are captured after the pool is allocated: their memory comes out of it
    assert kv_cache_budget(141 * gib, 0.97, 3 * gib, gib // 2, 2 * gib) == \
        int(141 * gib * 0.97) - 5 * gib - gib // 2


def test_profile_prompt_lengths():
    assert profile_prompt_lengths(2048, 2048, 256) == [2048]
    assert profile_prompt_lengths(2048, 512, 256) == [512] * 4
    assert profile_prompt_lengths(1000, 300, 256) == [250] * 4
    assert profile_prompt_lengths(8192, 64, 16) == [64] * 16  # both limits bind
    assert sum(profile_prompt_lengths(777, 100, 3)) == 300
    assert all(n <= 100 for n in profile_prompt_lengths(777, 100, 128))


def test_enforce_eager_and_triton_backend_in_config():
    from config.loader import load_config
    config = load_config(None, {"enforce_eager": True, "attention_backend": "triton"})
    assert config.worker.enforce_eager and config.worker.attention_backend == "triton"
    assert load_config(None, {}).worker.enforce_eager is False


def _greedy(llm, prompts, n):
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_triton_backend_gives_the_same_greedy_tokens(make_tiny_llm):
    """Chunked prefill (budget 24) mixed with decodes, through the interpreted kernel."""
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 49152) for _ in range(n)]}
               for n in (5, 30)]
    triton_llm = make_tiny_llm(attention_backend="triton", max_num_batched_tokens=24,
                               max_model_len=128, num_blocks=32)
    assert triton_llm.runner.attention_backend.is_triton
    ours = _greedy(triton_llm, prompts, 4)
    reference = _greedy(make_tiny_llm(attention_backend="torch", max_model_len=128,
                                      num_blocks=32), prompts, 4)
    assert ours == reference


def test_decode_graph_padding_matches_eager(make_tiny_llm, monkeypatch):
    """What a captured graph runs, on a batch padded from 3 to 4 rows, equals the eager
    step on the 3 real rows, and the padding writes nothing into the KV cache."""
    import worker.models.llama as llama
    from kernels.triton_reshape_and_cache import reshape_and_cache_triton
    # on CUDA the model writes K/V with the Triton kernel, which skips slot -1
    monkeypatch.setattr(llama, "reshape_and_cache", reshape_and_cache_triton)
    runner = make_tiny_llm(attention_backend="triton", max_model_len=64,
                           num_blocks=16).runner
    backend = runner.attention_backend
    assert backend == AttentionBackend(TRITON, CPU, num_kv_heads=2)
    rng = random.Random(1)
    states, next_block = [], 1
    for i, n in enumerate((3, 17, 9)):
        blocks = list(range(next_block, next_block + -(-(n + 1) // 16)))
        next_block += len(blocks)
        states.append(CachedRequestState(f"r{i}", [rng.randrange(3, 49152) for _ in range(n)],
                                         n, WorkerSamplingParams(), blocks, 0, None))
    with torch.inference_mode():
        prefill = build_input_batch(states, [len(s.token_ids) for s in states], 16, None,
                                    backend)
        runner.model(prefill.input_ids, prefill.positions, runner.kv_caches, prefill.attn)
        for s in states:
            s.num_computed_tokens = len(s.token_ids)
            s.token_ids.append(rng.randrange(3, 49152))
        decode = build_input_batch(states, [1, 1, 1], 16, None, backend)
        eager = runner.model(decode.input_ids, decode.positions, runner.kv_caches, decode.attn)
        cache_after_eager = [c.clone() for c in runner.kv_caches]
        graphs = DecodeCudaGraphs(runner.model, runner.kv_caches, [1, 4, 8], 5, backend,
                                  None, 64)
        runner_graphs = DecodeCudaGraphs.for_runner(runner, runner.kv_caches)
        assert runner_graphs.sizes == capture_sizes(runner.scheduler_config.max_num_seqs)
        assert runner_graphs.block_tables.shape == (runner_graphs.sizes[-1], 64 // 16 + 1)
        assert graphs.can_run(decode) and not graphs.can_run(prefill)
        size = graphs.fill(decode)
        assert size == 4
        assert graphs.slot_mapping[3].item() == -1 and graphs.seq_lens[3].item() == 0
        padded = graphs.forward(size)
    assert torch.isfinite(padded).all()
    torch.testing.assert_close(padded[:3], eager, atol=1e-5, rtol=1e-5)
    # Padding writes nothing: every slot but the 3 real ones is bit-identical. The real
    # slots are rewritten with K/V from a 4-row GEMM instead of a 3-row one; CPUs whose
    # GEMM rounds by row count (seen on an AMD EPYC) differ there in the last bit.
    real = graphs.slot_mapping[:3].tolist()
    for before, after in zip(cache_after_eager, runner.kv_caches):
        before, after = before.flatten(1, 2), after.flatten(1, 2)  # [2, slots, heads, dim]
        others = torch.ones(before.shape[1], dtype=torch.bool)
        others[real] = False
        assert torch.equal(before[:, others], after[:, others])
        torch.testing.assert_close(after[:, real], before[:, real], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_profiling_step_runs_the_largest_batch(make_tiny_llm, backend):
    """The step the GPU sizing measures: on the CPU only its shape can be checked."""
    from worker.gpu_memory import run_profile_step
    llm = make_tiny_llm(attention_backend=backend, max_model_len=48, num_blocks=16)
    runner = llm.runner
    scratch = run_profile_step(runner, max_num_batched_tokens=100, max_num_seqs=8)
    # 100 tokens as 3 prompts of at most 48 (34 + 33 + 33): 3 blocks each + the null one
    blocks = 1 + 3 * 3
    bytes_per_block = sum(c.nbytes // c.shape[1] for c in runner.kv_caches)  # all layers
    assert scratch == blocks * bytes_per_block
