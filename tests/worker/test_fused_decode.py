"""The fused decode layer (kernels/csrc/decode_layer.cpp) against its spec, the torch
decoder layers (worker/models/llama.py), on decode steps of tiny models.

Each case prefills three requests of different lengths through the torch layers, then
runs one decode step twice on copies of the KV cache: through the torch layers and
through the native op. The hidden states and the cache rows the step wrote must agree, for quantized weights (every linear path), 16-bit
weights (native GEMM, Folio's kernel, widening, oneDNN on prepacked weights), float32, attention bias (qwen2) and a
sliding window. The op calls the same kernels and torch ops with the same rounding
points, so they must agree bit for bit.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from config.schema import MemoryConfig, ModelConfig, WorkerConfig
from engine_core.worker_sampling import WorkerSamplingParams
from kernels import cpu_extension
from kernels import cpu_paged_attention as cpa
from tests.worker.gguf_factory import TinyModelSpec, write_tiny_gguf
from worker.input_batch import build_input_batch
from worker.kv_cache import KVCacheSpec, allocate_kv_cache
from worker.model_runner import ModelRunner
from worker.models import prepacked
from worker.models.linear_paths import amx_linear_takes
from worker.request_state import CachedRequestState

pytestmark = pytest.mark.skipif(not cpu_extension.is_available(),
                                reason="native CPU kernels unavailable")
PROMPTS = [[1, 5, 9, 17, 33, 2, 40, 41, 7, 3, 60, 12, 8, 20, 50, 30, 11, 4, 6],
           [3, 8, 13, 21],
           [7, 7, 9, 1, 2, 3, 4, 5, 6, 10, 11, 12, 13, 14, 15, 16, 18, 19, 22, 23, 24, 25,
            26, 27, 28, 29, 31, 32, 34, 35, 36, 37, 38]]
BLOCK = 16


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("fused")
    specs = {
        "q4_1": TinyModelSpec(proj_type=Q.Q4_1, embed_type=Q.Q8_0, weight_scale=0.1,
                              intermediate_size=128, num_layers=3),
        "q8_0": TinyModelSpec(proj_type=Q.Q8_0, embed_type=Q.Q8_0, weight_scale=0.1,
                              intermediate_size=128, num_layers=2),
        "f16": TinyModelSpec(proj_type=Q.F16, weight_scale=0.1, num_layers=3),
        "f16_hd64": TinyModelSpec(proj_type=Q.F16, weight_scale=0.1, num_layers=2,
                                  hidden_size=128, num_heads=2, num_kv_heads=1),
        "qwen2": TinyModelSpec(arch="qwen2", proj_type=Q.F16, weight_scale=0.1,
                               num_layers=2),
        "q4_1_qwen2": TinyModelSpec(arch="qwen2", proj_type=Q.Q4_1, embed_type=Q.Q8_0,
                                    weight_scale=0.1, intermediate_size=128, num_layers=2),
    }
    for arch in ("llama", "qwen2"):  # Q4_K_M's mix: a Q6_K v beside Q4_K q and k
        specs[f"q4_k_m_{arch}"] = TinyModelSpec(
            arch=arch, hidden_size=256, intermediate_size=512, num_layers=2,
            weight_scale=0.1, proj_type=Q.Q4_K, embed_type=Q.Q6_K,
            part_types={"attn_v": Q.Q6_K, "ffn_down": Q.Q6_K})
    paths = {}
    for name, spec in specs.items():
        paths[name] = root / f"{name}.gguf"
        write_tiny_gguf(paths[name], spec)
    return paths


def runner_for(path, dtype, backend="auto", quantization="auto") -> ModelRunner:
    return ModelRunner(ModelConfig(path=str(path), dtype=dtype, quantization=quantization),
                       MemoryConfig(num_blocks=16),
                       WorkerConfig(device="cpu", linear_backend=backend))


def states(prompts=PROMPTS) -> list[CachedRequestState]:
    out, next_block = [], 1
    for i, prompt in enumerate(prompts):
        blocks = list(range(next_block, next_block + len(prompt) // BLOCK + 1))
        next_block += len(blocks)
        out.append(CachedRequestState(f"r{i}", list(prompt), len(prompt),
                                      WorkerSamplingParams(), blocks, 0, None))
    return out


@torch.inference_mode()
def decode_both_ways(runner: ModelRunner, sliding_window=None, kv_dtype=None,
                     prompts=PROMPTS, stack=None):
    """(torch, fused) results of one decode step after a torch prefill: each the final
    hidden states and the KV caches after the step (``kv_dtype``: the cache's, default
    the activations'). ``stack``: whether the op must (True) or must not (False)
    run the step as its row stack (decode_layer.cpp), None: either."""
    model = runner.model
    fused = model.fused_decode
    assert fused is not None
    caches = allocate_kv_cache(KVCacheSpec.for_model(runner.arch, BLOCK, kv_dtype or runner.dtype),
                               16, runner.device)
    reqs = states(prompts)
    prefill = build_input_batch(reqs, [len(p) for p in prompts], BLOCK, sliding_window,
                                runner.attention_backend)
    model(prefill.input_ids, prefill.positions, caches, prefill.attn)
    for i, r in enumerate(reqs):
        r.num_computed_tokens = len(r.token_ids)
        r.token_ids.append(44 + i)
    decode = build_input_batch(reqs, [1] * len(reqs), BLOCK, sliding_window,
                               runner.attention_backend)
    assert fused.takes(len(reqs), runner.dtype, caches, decode.attn)
    if stack is not None:
        assert fused.stack_takes(decode.input_ids.shape[0], runner.dtype, caches) \
            == stack
    results = []
    for use_fused in (False, True):
        step_caches = [c.clone() for c in caches]
        model.fused_decode = fused if use_fused else None
        hidden = model(decode.input_ids, decode.positions, step_caches, decode.attn)
        results.append((hidden, step_caches))
    model.fused_decode = fused
    return results


def assert_same(results):
    """Bit for bit: the op runs the same kernels and torch ops with the same rounding."""
    (h_ref, c_ref), (h, c) = results
    assert torch.equal(h, h_ref)
    for got, want in zip(c, c_ref):
        if got.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):  # compare the bytes
            got, want = got.view(torch.uint8), want.view(torch.uint8)
        assert torch.equal(got, want)
    assert c_ref[0].view(torch.uint8).any()


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0", "q4_k_m_llama", "q4_k_m_qwen2"])
@pytest.mark.parametrize("backend", ["auto", "widen", "int8", "int16", "bf16dot", "amx", "native"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_quantized_weights_every_path(models, fmt, backend, dtype):
    runner = runner_for(models[fmt], dtype, backend)
    assert runner.quantization == "gguf"
    assert_same(decode_both_ways(runner))


LONG_PROMPT = [(7 * i + 3) % 60 + 1 for i in range(200)]  # 13 blocks: partitioned keys


INT16_BUILT = cpu_extension.is_available() and 7 in cpu_extension.require().quant_routes()


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0", "q4_1_qwen2", "q4_k_m_llama", "q4_k_m_qwen2"])
@pytest.mark.parametrize("backend", ["int8", "int16", "widen", "bf16dot"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("prompts", [[PROMPTS[0]], [LONG_PROMPT], PROMPTS],
                         ids=["1x19", "1x200", "3rows"])
def test_a_few_rows_run_every_layer_in_one_region(models, fmt, backend, dtype, prompts):
    """At a few rows with quantized weights the op runs its row stack (one parallel
    region for all layers): the same bits as the torch layers, the qkv bias (qwen2), a
    q/k/v projection in two formats (Q4_K_M: a Q6_K v) and rows whose keys are cut into
    partitions (200) included."""
    if backend == "int16" and not INT16_BUILT:
        pytest.skip("the int16 route is built on AVX2 CPUs only")
    # (bf16dot on float32 activations or Q8_0 weights runs the widening route: also taken)
    runner = runner_for(models[fmt], dtype, backend)
    assert_same(decode_both_ways(runner, prompts=prompts, stack=True))


@pytest.mark.parametrize("fmt", ["f16", "qwen2"])
@pytest.mark.parametrize("prompt", [PROMPTS[0], LONG_PROMPT], ids=["19", "200"])
def test_one_row_with_16_bit_weights_on_folios_kernel(models, fmt, prompt):
    """bf16 weights on the `kernel` path (half_linear) take the stack too, qkv bias
    (qwen2) included; on torch's GEMM or oneDNN they do not."""
    runner = runner_for(models[fmt], "bfloat16", "kernel", quantization="none")
    assert_same(decode_both_ways(runner, prompts=[prompt], stack=True))
    runner = runner_for(models[fmt], "bfloat16", "native", quantization="none")
    assert_same(decode_both_ways(runner, prompts=[prompt], stack=False))


@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn], ids=["same", "e4m3fn"])
def test_one_row_with_a_window_or_an_fp8_cache(models, kv_dtype):
    runner = runner_for(models["q4_1"], "bfloat16", "int8")
    assert_same(decode_both_ways(runner, kv_dtype=kv_dtype, prompts=[LONG_PROMPT],
                                 stack=True))
    assert_same(decode_both_ways(runner, sliding_window=70, kv_dtype=kv_dtype,
                                 prompts=[LONG_PROMPT], stack=True))


def test_one_row_at_more_threads_than_cores(models):
    """The stack's threads wait for each other at barriers: oversubscribed (3 and 4
    threads here, on any core count) they still meet, with the same bits."""
    runner = runner_for(models["q4_1"], "bfloat16", "int8")
    before = torch.get_num_threads()
    try:
        for threads in (3, 4):
            torch.set_num_threads(threads)
            assert_same(decode_both_ways(runner, prompts=[LONG_PROMPT], stack=True))
    finally:
        torch.set_num_threads(before)


def test_the_stack_takes_only_what_it_runs(models):
    """Nine rows (more than a tile), one thread or dequantised weights (the native path)
    go layer by layer, with the same bits; eight rows take the stack."""
    runner = runner_for(models["q4_1"], "bfloat16", "int8")
    short = [[(5 * i + j) % 60 + 1 for j in range(3 + i)] for i in range(9)]  # a block each
    assert_same(decode_both_ways(runner, prompts=short, stack=False))
    assert_same(decode_both_ways(runner, prompts=short[:8], stack=True))
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert_same(decode_both_ways(runner, prompts=[PROMPTS[0]], stack=False))
    finally:
        torch.set_num_threads(before)
    assert_same(decode_both_ways(runner_for(models["q4_1"], "bfloat16", "native"),
                                 prompts=[PROMPTS[0]], stack=False))


def skip_unless_runs(backend):
    if backend == "mkldnn" and not prepacked.available():
        pytest.skip("oneDNN bf16 linear unavailable on this CPU")
    if backend == "amx" and not amx_linear_takes(torch.empty(16, 32, dtype=torch.bfloat16),
                                                 torch.bfloat16):
        pytest.skip("the bf16 AMX tile kernel is not built here (no AMX-BF16)")


@pytest.mark.parametrize("backend", ["auto", "kernel", "widen", "native", "mkldnn", "amx"])
def test_bf16_weights_every_path(models, backend):
    skip_unless_runs(backend)
    runner = runner_for(models["f16"], "bfloat16", backend, quantization="none")
    if backend in ("mkldnn", "amx"):  # mkldnn: the oneDNN copies in the scales slots
        assert runner.model.layers[0].mlp.down_proj.choice.paths[0] == backend
    assert_same(decode_both_ways(runner))
    assert all(w is None or not w.is_mkldnn for w in runner.model.fused_decode.weights)


def test_float32_weights_and_sliding_window(models):
    runner = runner_for(models["f16"], "float32", quantization="none")
    assert_same(decode_both_ways(runner))
    assert_same(decode_both_ways(runner, sliding_window=5))


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2],
                         ids=["e4m3fn", "e5m2"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_fp8_kv_cache(models, dtype, kv_dtype):
    """The fused op writes an fp8 cache as kv_quant.quantize_kv does (clamped, rounded to
    nearest even) and reads it back through the same attention kernel."""
    runner = runner_for(models["q4_k_m_llama"], dtype, "auto")
    assert_same(decode_both_ways(runner, kv_dtype=kv_dtype))


@pytest.mark.parametrize("dtype,backend", [("float32", "auto"), ("bfloat16", "auto"),
                                           ("bfloat16", "mkldnn"), ("bfloat16", "amx")])
def test_attention_bias(models, dtype, backend):
    skip_unless_runs(backend)
    runner = runner_for(models["qwen2"], dtype, backend, quantization="none")
    assert runner.model.layers[0].self_attn.qkv_proj.bias is not None
    assert_same(decode_both_ways(runner))


def test_steps_the_op_does_not_take(models):
    """Prefill rows, an int8 KV cache and the torch attention backend keep the torch
    layers; so does ``worker.fused_decode: false``."""
    runner = runner_for(models["f16"], "float32", quantization="none")
    fused = runner.model.fused_decode
    spec = KVCacheSpec.for_model(runner.arch, BLOCK, runner.dtype)
    caches = allocate_kv_cache(spec, 16, runner.device)
    reqs = states()
    prefill = build_input_batch(reqs, [len(p) for p in PROMPTS], BLOCK, None,
                                runner.attention_backend)
    assert not fused.takes(prefill.input_ids.shape[0], runner.dtype, caches, prefill.attn)
    for r in reqs:
        r.num_computed_tokens = len(r.token_ids)
        r.token_ids.append(3)
    decode = build_input_batch(reqs, [1, 1, 1], BLOCK, None, runner.attention_backend)
    int8 = [torch.zeros_like(c, dtype=torch.int8) for c in caches]
    assert not fused.takes(3, runner.dtype, int8, decode.attn)
    torch_decode = build_input_batch(reqs, [1, 1, 1], BLOCK, None, None)
    assert not fused.takes(3, runner.dtype, caches, torch_decode.attn)
    off = ModelRunner(ModelConfig(path=str(models["f16"]), dtype="float32", quantization="none"),
                      MemoryConfig(num_blocks=16), WorkerConfig(device="cpu", fused_decode=False))
    assert off.model.fused_decode is None


def test_bad_operands_are_refused(models):
    runner = runner_for(models["f16"], "float32", quantization="none")
    fused = runner.model.fused_decode
    ops = cpu_extension.require()
    spec = KVCacheSpec.for_model(runner.arch, BLOCK, runner.dtype)
    cache = allocate_kv_cache(spec, 2, runner.device)[0]
    hidden = torch.randn(1, 64)
    cos = sin = torch.ones(1, 8)
    tables, lens = torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, dtype=torch.int64)
    per_layer = len(fused._meta(1, torch.float32)) // len(fused.layers)
    meta = fused._meta(1, torch.float32)[:per_layer]
    args = (hidden, None, fused.layers[0], meta, cache)
    with pytest.raises(RuntimeError, match="outside the cache"):
        ops.decode_layer(*args, torch.tensor([32]), tables, lens, cos, sin, 1e-6, 0.25)
    with pytest.raises(RuntimeError, match="dtype"):
        ops.decode_layer(hidden, None, fused.layers[0], meta, cache.bfloat16(),
                         torch.tensor([0]), tables, lens, cos, sin, 1e-6, 0.25)
    with pytest.raises(RuntimeError, match="meta"):
        ops.decode_layer(*args[:3], meta[:-1], cache, torch.tensor([0]), tables, lens, cos,
                         sin, 1e-6, 0.25)


def test_the_all_layers_op_refuses_lists_that_do_not_fit_its_caches(models):
    runner = runner_for(models["f16"], "float32", quantization="none")
    fused = runner.model.fused_decode
    ops = cpu_extension.require()
    spec = KVCacheSpec.for_model(runner.arch, BLOCK, runner.dtype)
    caches = allocate_kv_cache(spec, 2, runner.device)
    meta = fused._meta(1, torch.float32)
    rest = (torch.tensor([0]), torch.zeros(1, 1, dtype=torch.int64),
            torch.ones(1, dtype=torch.int64), torch.ones(1, 8), torch.ones(1, 8), 1e-6, 0.25)
    hidden = torch.randn(1, 64)
    with pytest.raises(RuntimeError, match="weights must hold"):
        ops.decode_layers(hidden, fused.weights, meta, caches[:-1], *rest)
    with pytest.raises(RuntimeError, match="meta must hold"):
        ops.decode_layers(hidden, fused.weights, meta[:-1], caches, *rest)
    out, residual = ops.decode_layers(hidden, fused.weights, meta, caches, *rest)
    assert out.shape == residual.shape == (1, 64) and torch.isfinite(out).all()


def test_the_decode_v_pass_reaches_the_op_and_the_layers_alike(models):
    """The backend's decode V pass (worker/decode_v_pass.py) goes through the step's plan
    to the unfused kernel and to the op, row stack and layer by layer: the same bits both
    ways for every pass built, and the passes' results differ, so the choice is taken."""
    runs = {}  # head_dim 64 (the paired pass's): Q4_K_M on the row stack, f16 not on it
    for fmt, backend, quantization, stack in (("q4_k_m_llama", "int8", "auto", True),
                                              ("f16_hd64", "native", "none", False)):
        runner = runner_for(models[fmt], "bfloat16", backend, quantization=quantization)
        for name in cpa.decode_v_passes():
            runner.attention_backend = replace(runner.attention_backend, decode_v_pass=name)
            runs[fmt, name] = decode_both_ways(runner, prompts=[LONG_PROMPT, PROMPTS[1]],
                                               stack=stack)
            assert_same(runs[fmt, name])
        if len(cpa.decode_v_passes()) > 1:
            assert not torch.equal(runs[fmt, "paired"][1][0], runs[fmt, "widened"][1][0])
