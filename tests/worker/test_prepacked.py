"""worker/models/prepacked.py: the mkldnn path against F.linear, and its packed copy
following the weight (updates, storage swaps) and going when dropped."""
import pytest
import torch
import torch.nn.functional as F

from worker.linear_backend import keep_packed, shape_key
from worker.models import prepacked
from worker.models.linear_paths import MKLDNN, NATIVE, candidates, run_path

pytestmark = pytest.mark.skipif(not prepacked.available(),
                                reason="oneDNN bf16 linear unavailable on this CPU")


@pytest.mark.parametrize("rows", [1, 3, 16, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_f_linear_within_a_rounding(rows, bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 160, generator=g).bfloat16()
    b = torch.randn(96, generator=g).bfloat16() if bias else None
    x = torch.randn(2, rows, 160, generator=g).bfloat16()  # leading dims are kept
    got = run_path(MKLDNN, x, w, b)
    want = F.linear(x, w, b)
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert got.shape == want.shape == (2, rows, 96) and got.dtype == torch.bfloat16
    # both round a float32 sum once: at most one bf16 step apart, and near the reference
    assert torch.allclose(got.float(), want.float(), rtol=2 ** -7, atol=1e-2)
    assert (got.float() - ref).abs().max() <= 2 ** -7 * ref.abs().max() + 1e-2


def test_is_a_candidate_for_bf16_weights_only():
    assert candidates(torch.zeros(16, 32, dtype=torch.bfloat16))[0] == MKLDNN
    assert MKLDNN not in candidates(torch.zeros(16, 32, dtype=torch.bfloat16),
                                    dtype=torch.float32)
    assert MKLDNN not in candidates(torch.zeros(16, 32))
    assert MKLDNN not in candidates(torch.zeros(16, 32, dtype=torch.float16))


def test_the_copy_follows_updates_and_storage_swaps():
    w = torch.nn.Parameter(torch.randn(64, 128).bfloat16(), requires_grad=False)
    x = torch.randn(8, 128).bfloat16()
    first = run_path(MKLDNN, x, w, None)
    copy = prepacked.packed(w)
    assert prepacked.packed(w) is copy  # kept while the weight is unchanged
    with torch.no_grad():
        w.copy_(torch.randn(64, 128).bfloat16())  # a weight update
    assert prepacked.packed(w) is not copy
    assert torch.allclose(run_path(MKLDNN, x, w, None).float(), F.linear(x, w).float(),
                          rtol=2 ** -7, atol=1e-2)
    assert not torch.equal(run_path(MKLDNN, x, w, None), first)
    w.data = torch.randn(64, 128).bfloat16()  # sleep mode's reload swaps the storage
    assert torch.allclose(run_path(MKLDNN, x, w, None).float(), F.linear(x, w).float(),
                          rtol=2 ** -7, atol=1e-2)


def test_only_layers_that_run_the_path_keep_a_copy():
    a, b = torch.randn(32, 64).bfloat16(), torch.randn(48, 64).bfloat16()
    prepacked.packed(a), prepacked.packed(b)  # the timing packed both
    layers = [(None, "choice", a), (None, "choice", b)]
    keep_packed(layers, {shape_key(a): [MKLDNN, NATIVE], shape_key(b): [NATIVE, NATIVE]})
    assert prepacked.has_packed(a) and not prepacked.has_packed(b)
    prepacked.drop(a)
    assert not prepacked.has_packed(a)


def test_deterministic_mode_drops_the_copies(tiny_bf16_model):
    model = tiny_bf16_model
    weights = [m.weight for m in model.modules() if hasattr(m, "choice")]
    for w in weights:
        prepacked.packed(w)
    model.make_batch_invariant()  # its padded linears never read them
    assert not any(prepacked.has_packed(w) for w in weights)


@pytest.fixture
def tiny_bf16_model():
    from worker.models.architecture import ModelArchitecture
    from worker.models.registry import build_model
    arch = ModelArchitecture(architecture="llama", vocab_size=64, hidden_size=32,
                             intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                             rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
                             tie_word_embeddings=True, attention_bias=False,
                             max_position_embeddings=64)
    return build_model(arch, 64).to(torch.bfloat16)
