"""Deterministic mode's linear layers: every row the same bits at any row count, on the
machine the test runs on (the property worker/models/linear.py relies on), and the
model-level switch that puts them in place."""
import pytest
import torch

from worker.models.linear import (INVARIANT_ROW_MULTIPLE, InvariantLinear, Linear,
                                  invariant_linear, k_major, use_invariant_linears)

# SmolLM2's projection shapes (in, out): qkv, gate_up, down; and a small odd one
SHAPES = [(576, 960), (576, 3072), (1536, 576), (64, 48)]
ROW_COUNTS = [*range(1, 20), 31, 33, 64, 100, 257, 600]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["row-major", "k-major"])
@pytest.mark.parametrize("k,n", SHAPES)
def test_each_row_is_the_same_bits_at_any_row_count(dtype, layout, k, n):
    gen = torch.Generator().manual_seed(k + n)
    weight = (torch.randn(n, k, generator=gen) * 0.05).to(dtype)
    if layout == "k-major":
        weight = k_major(weight)
    bias = (torch.randn(n, generator=gen) * 0.1).to(dtype)
    x = torch.randn(max(ROW_COUNTS), k, generator=gen).to(dtype)
    full = invariant_linear(x, weight, bias)
    for rows in ROW_COUNTS:
        # the first rows alone, and the last rows (other neighbours, other offsets)
        assert torch.equal(invariant_linear(x[:rows], weight, bias), full[:rows]), rows
        assert torch.equal(invariant_linear(x[-rows:], weight, bias), full[-rows:]), rows


def test_native_half_kernel_rows_are_the_same_bits_at_any_row_count():
    # the path invariant_linear takes for bf16 on a CPU without bf16 instructions
    from kernels import cpu_extension
    if not cpu_extension.is_available():
        pytest.skip(f"native CPU kernels: {cpu_extension.unavailable_reason()}")
    gen = torch.Generator().manual_seed(3)
    weight = (torch.randn(960, 576, generator=gen) * 0.05).bfloat16()
    x = torch.randn(600, 576, generator=gen).bfloat16()
    full = cpu_extension.require().half_linear(x, weight, None)
    for rows in ROW_COUNTS:
        assert torch.equal(cpu_extension.require().half_linear(x[-rows:], weight, None),
                           full[-rows:]), rows


def test_matches_linear_up_to_rounding_and_keeps_leading_dims():
    weight, x = torch.randn(32, 64), torch.randn(2, 3, 64)
    out = invariant_linear(x, weight)
    assert out.shape == (2, 3, 32) and INVARIANT_ROW_MULTIPLE > 6
    torch.testing.assert_close(out, torch.nn.functional.linear(x, weight))


def test_model_switch_turns_every_linear_and_the_head():
    from worker.models.architecture import ModelArchitecture
    from worker.models.llama import LlamaForCausalLM
    arch = ModelArchitecture(architecture="llama", vocab_size=128, hidden_size=32,
                             intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                             max_position_embeddings=64, rms_norm_eps=1e-6,
                             tie_word_embeddings=True)
    model = LlamaForCausalLM(arch, 64)
    num_linear = sum(type(m) is Linear for m in model.modules())
    assert num_linear == 2 * 4
    model.make_batch_invariant()
    assert sum(type(m) is InvariantLinear for m in model.modules()) == num_linear
    assert model.is_batch_invariant
    assert use_invariant_linears(model) == 0  # nothing left to turn
