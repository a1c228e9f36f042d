"""Weights moved onto huge pages (worker/huge_pages.py): the same model, the same bits.

A runner that moved its weights must compute exactly what one that did not computes,
through the torch layers and through the fused decode layer, with every weight (tied
embeddings, a K-major head copy, packed quantized blocks) now inside one buffer."""
from __future__ import annotations

import mmap

import pytest
import torch
from gguf import GGMLQuantizationType as Q

import worker.huge_pages as hp
from config.schema import MemoryConfig, ModelConfig, WorkerConfig
from kernels import cpu_extension
from tests.worker.gguf_factory import TinyModelSpec, write_tiny_gguf
from tests.worker.test_fused_decode import decode_both_ways
from worker.kv_cache import KVCacheSpec, allocate_kv_cache
from worker.model_runner import ModelRunner

pytestmark = pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"),
                                reason="no madvise(MADV_HUGEPAGE) on this platform")


def test_buffer_is_aligned_zeroed_and_writable():
    buf = hp.huge_page_buffer(5 * hp.HUGE_PAGE + 123)
    assert buf.numel() == 5 * hp.HUGE_PAGE + 123 and buf.dtype == torch.uint8
    assert buf.data_ptr() % hp.HUGE_PAGE == 0
    assert not buf.any()
    buf.fill_(7)
    assert int(buf.sum()) == 7 * buf.numel()


def _runner(path, dtype, quantization, huge_pages) -> ModelRunner:
    # one forced linear path: measured at load, two runners on a busy machine could
    # choose differently, and exact paths differ in their summation order
    return ModelRunner(ModelConfig(path=str(path), dtype=dtype, quantization=quantization),
                       MemoryConfig(num_blocks=16),
                       WorkerConfig(device="cpu", huge_pages=huge_pages, linear_backend="widen"))


@pytest.mark.parametrize("case", ["q4_1", "f16_bf16", "f16_f32"])
def test_moved_weights_compute_the_same_bits(tmp_path, monkeypatch, case):
    if not cpu_extension.is_available():
        pytest.skip("native CPU kernels unavailable")
    spec = (TinyModelSpec(proj_type=Q.Q4_1, embed_type=Q.Q8_0, weight_scale=0.1,
                          intermediate_size=128, num_layers=2) if case == "q4_1"
            else TinyModelSpec(proj_type=Q.F16, weight_scale=0.1, num_layers=2))
    path = tmp_path / f"{case}.gguf"
    write_tiny_gguf(path, spec)
    dtype = "float32" if case == "f16_f32" else "bfloat16"
    quantization = "auto" if case == "q4_1" else "none"
    monkeypatch.setattr(hp, "MIN_BYTES", 0)  # the tiny model moves too
    plain = _runner(path, dtype, quantization, huge_pages=False)
    moved = _runner(path, dtype, quantization, huge_pages=True)

    tensors = hp._weight_tensors(moved.model)
    arena = {t.untyped_storage().data_ptr() for t in tensors}
    assert len(arena) == 1  # one buffer
    assert len({t.untyped_storage().data_ptr()
                for t in hp._weight_tensors(plain.model)}) > 1
    if case == "q4_1":
        assert moved.quantization == "gguf"
        packed = moved.model.layers[0].mlp.down_proj.weight
        assert {packed.qs.untyped_storage().data_ptr()} == arena
    head = moved.model.head_weight  # a packed head or a K-major copy moved along
    if head is not None:
        assert {getattr(head, "qs", head).untyped_storage().data_ptr()} == arena
    for (h_ref, c_ref), (h, c) in zip(decode_both_ways(plain), decode_both_ways(moved)):
        assert torch.equal(h, h_ref)
        assert all(torch.equal(a, b) for a, b in zip(c, c_ref))


def test_small_models_stay_as_loaded(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, TinyModelSpec(proj_type=Q.F16, num_layers=1))
    runner = _runner(path, "float32", "none", huge_pages=True)
    assert hp.move_to_huge_pages(runner.model) == 0  # under MIN_BYTES
    assert len({t.untyped_storage().data_ptr()
                for t in hp._weight_tensors(runner.model)}) > 1


def test_weights_return_to_huge_pages_after_a_level_2_sleep(tmp_path, monkeypatch):
    """Sleep level 2 frees the buffer with the parameters; waking reloads the weights
    and moves them back into one buffer, computing what they computed before."""
    if not cpu_extension.is_available():
        pytest.skip("native CPU kernels unavailable")
    from worker.sleep_mode import SleepMode
    path = tmp_path / "f16.gguf"
    write_tiny_gguf(path, TinyModelSpec(proj_type=Q.F16, weight_scale=0.1, num_layers=2))
    monkeypatch.setattr(hp, "MIN_BYTES", 0)
    plain = _runner(path, "bfloat16", "none", huge_pages=False)
    moved = _runner(path, "bfloat16", "none", huge_pages=True)
    moved.kv_caches = allocate_kv_cache(KVCacheSpec.for_model(moved.arch, 16, moved.dtype), 16,
                                        moved.device)
    sleep = SleepMode(moved)
    sleep.sleep(2)
    assert all(t.numel() == 0 for t in moved.model.parameters())
    sleep.wake_up()
    assert len({t.untyped_storage().data_ptr() for t in hp._weight_tensors(moved.model)}) == 1
    for (h_ref, _), (h, _) in zip(decode_both_ways(plain), decode_both_ways(moved)):
        assert torch.equal(h, h_ref)
