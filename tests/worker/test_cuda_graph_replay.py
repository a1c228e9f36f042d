"""CUDA-graph replay on a GPU is the eager forward pass, and touches only its own slots.

On a random SmolLM2-shaped model in float32, each decode step is run three ways from
the same KV cache: replayed from the captured graph (first, right after the previous
batch's replay, so stale buffers would show), eagerly on the same padded batch (what
the graph captured: its "eager twin") and eagerly on the real rows alone. Then:

- hidden states: replay within 1e-4 of the eager forward (float32);
- KV cache: bit-identical to the eager twin's after every step, and every slot but the
  batch's own is bit-identical to before (padding rows write nothing); the real slots
  within 1e-4 of the unpadded eager step (a GEMM over 4 rows may round unlike one
  over 3, so bit-identity there is reported, not required).

Batches of 3, 17 and 130 requests pad to captured sizes 4, 32 and 144; two different
batches in one size follow each other; each batch decodes two steps, the second
reading what the first replay wrote. A second test sizes the KV pool at
gpu_memory_utilization 0.97 and checks the graphs fit inside it. Skipped without CUDA
(tests/worker/test_gpu_path.py checks on the CPU what it can: the padded forward a
graph captures, run eagerly through the interpreted kernels).
"""
import gc
import random

import pytest
import torch

from config.schema import MemoryConfig, ModelConfig, SchedulerConfig, WorkerConfig
from engine_core.worker_sampling import WorkerSamplingParams
from worker.input_batch import build_input_batch
from worker.model_runner import ModelRunner
from worker.request_state import CachedRequestState

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA device (graph capture and replay exist only there); "
           "tests/worker/test_gpu_path.py checks the padded forward on the CPU")
BLOCK = 16
VOCAB = 49152


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from benchmarks.random_checkpoints import write_checkpoint
    return write_checkpoint("smollm2-random", tmp_path_factory.mktemp("smollm2"),
                            device="cuda")


def _runner(checkpoint, dtype: str, memory: MemoryConfig, max_num_seqs: int) -> ModelRunner:
    runner = ModelRunner(ModelConfig(path=str(checkpoint), dtype=dtype, max_model_len=1024),
                         memory, WorkerConfig(device="cuda"),
                         SchedulerConfig(max_num_seqs=max_num_seqs,
                                         max_num_batched_tokens=4096))
    runner.initialize_kv_cache()
    assert runner.cuda_graphs is not None
    return runner


class Blocks:
    """Hands out fresh block ids (block 0 is the null block)."""

    def __init__(self):
        self.next = 1

    def take(self, n: int) -> list[int]:
        self.next += n
        return list(range(self.next - n, self.next))


def _prefilled(runner, blocks: Blocks, lengths: list[int], rng,
               chunk: int = 32) -> list[CachedRequestState]:
    """Requests with prompts of ``lengths`` computed into the cache (eagerly, ``chunk``
    requests a step), each holding one new token to decode; blocks for two steps."""
    states = [CachedRequestState(f"r{blocks.next}-{i}",
                                 [rng.randrange(3, VOCAB) for _ in range(n)], n,
                                 WorkerSamplingParams(), blocks.take(-(-(n + 2) // BLOCK)), 0,
                                 None) for i, n in enumerate(lengths)]
    with torch.inference_mode():
        for i in range(0, len(states), chunk):
            part = states[i:i + chunk]
            batch = build_input_batch(part, [len(s.token_ids) for s in part], BLOCK, None,
                                      runner.attention_backend)
            runner.forward(batch)
    for s in states:
        s.num_computed_tokens = len(s.token_ids)
        s.token_ids.append(rng.randrange(3, VOCAB))
    return states


def _snapshot(runner) -> list[torch.Tensor]:
    return [c.clone() for c in runner.kv_caches]


def _restore(runner, caches) -> None:
    for cache, saved in zip(runner.kv_caches, caches):
        cache.copy_(saved)


def _slots(cache: torch.Tensor) -> torch.Tensor:
    return cache.flatten(1, 2)  # [2, num_slots, kv_heads, head_dim]


@torch.inference_mode()
def _check_decode_step(runner, states) -> dict:
    """One decode step three ways (see the module doc); leaves the replay's cache."""
    graphs, n = runner.cuda_graphs, len(states)
    batch = build_input_batch(states, [1] * n, BLOCK, None, runner.attention_backend)
    assert graphs.can_run(batch) and batch.is_decode_only
    before = _snapshot(runner)
    replayed = runner.forward(batch).clone()  # graphs.run: fill, pad, replay
    after_replay = _snapshot(runner)
    _restore(runner, before)
    size = graphs.fill(batch)
    twin = graphs.forward(size)[:n].clone()
    after_twin = _snapshot(runner)
    _restore(runner, before)
    eager = runner.model(batch.input_ids, batch.positions, runner.kv_caches, batch.attn)
    after_eager = _snapshot(runner)
    _restore(runner, after_replay)

    assert (replayed - eager).abs().max().item() <= 1e-4
    real = torch.zeros(_slots(before[0]).shape[1], dtype=torch.bool, device=replayed.device)
    real[batch.attn.slot_mapping] = True
    exact_real = True
    for old, rep, tw, eag in zip(before, after_replay, after_twin, after_eager):
        assert torch.equal(rep, tw), "the replay's KV differs from what it captured"
        assert torch.equal(_slots(rep)[:, ~real], _slots(old)[:, ~real]), \
            "a padding row (or a stale slot) wrote into the cache"
        assert (_slots(rep)[:, real] - _slots(eag)[:, real]).abs().max().item() <= 1e-4
        exact_real &= torch.equal(_slots(rep)[:, real], _slots(eag)[:, real])
    for s in states:  # the next step reads what this replay wrote
        s.num_computed_tokens += 1
        s.token_ids.append(int(s.token_ids[-1] * 7 % VOCAB))
    return {"size": size, "hidden_equal_twin": torch.equal(replayed, twin),
            "real_slots_equal_unpadded": exact_real}


def test_graphs_fit_the_kv_budget_at_097(checkpoint):
    """The pool is sized with the graphs' memory reserved: at 0.97 of the GPU, capture
    and then the largest prefill and decode steps run without running out."""
    runner = _runner(checkpoint, "bfloat16", MemoryConfig(gpu_memory_utilization=0.97),
                     max_num_seqs=256)
    free, total = torch.cuda.mem_get_info()
    graphs = runner.cuda_graphs
    assert 0 < graphs.memory_bytes <= runner.graph_reserve_bytes * 1.05 + 2 ** 24
    # idle, the GPU holds the budget less the profiled step's activations (~100 MiB
    # here) plus the second capture's cuBLAS workspace: allow that workspace
    assert total - free <= 0.97 * total + 2 ** 26, (total - free) / total
    rng, blocks = random.Random(0), Blocks()
    states = _prefilled(runner, blocks, [14] * 256, rng, chunk=256)  # 3584 tokens at once
    with torch.inference_mode():
        batch = build_input_batch(states, [1] * 256, BLOCK, None, runner.attention_backend)
        assert graphs.can_run(batch)
        assert torch.isfinite(runner.forward(batch)).all()
    del runner, graphs, batch
    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def runner(checkpoint):
    return _runner(checkpoint, "float32", MemoryConfig(num_blocks=4096, block_size=BLOCK),
                   max_num_seqs=160)


@pytest.fixture(scope="module")
def blocks():
    return Blocks()  # the tests below share one pool: about 3,700 of its 4,096 blocks


@pytest.mark.parametrize("n, lengths", [(3, (200, 700)), (17, (1, 600)), (130, (1, 200))])
def test_replay_matches_eager(runner, blocks, n, lengths):
    rng = random.Random(n)
    states = _prefilled(runner, blocks, [rng.randint(*lengths) for _ in range(n)], rng)
    first = _check_decode_step(runner, states)
    second = _check_decode_step(runner, states)
    assert first["size"] == second["size"] == {3: 4, 17: 32, 130: 144}[n]
    print(f"batch {n}: {first} {second}")


def test_two_batches_back_to_back(runner, blocks):
    """30 requests, then 17 others in the same captured size (32): the second replay
    must not see the first's rows, slots, lengths or wider block tables."""
    rng = random.Random(7)
    wide = _prefilled(runner, blocks, [rng.randint(300, 600) for _ in range(30)], rng)
    narrow = _prefilled(runner, blocks, [rng.randint(1, 40) for _ in range(17)], rng)
    assert _check_decode_step(runner, wide)["size"] == 32
    assert _check_decode_step(runner, narrow)["size"] == 32
    assert _check_decode_step(runner, wide)["size"] == 32
