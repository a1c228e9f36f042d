"""Shared factories: tiny random checkpoints, the default model, configured LLMs."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Under pytest-xdist (`-n 2`, the README's test command) each worker, and every process
# its tests start, runs torch on one thread: two workers with two OpenMP threads each on
# two cores make every parallel region wait for a descheduled thread, which made the
# model tests several times slower than in one process. Set before torch is imported.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
# Triton kernels run in Triton's interpreter (on CPU tensors) unless the machine has an
# NVIDIA GPU. Set here, before any test module imports kernels/: @triton.jit reads it
# when a kernel is defined. TRITON_INTERPRET=0 forces real kernels.
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

TINY_VOCAB = 49152  # the default model's vocabulary, so its tokenizer serves tiny models


def _save_tiny(path, kind: str, seed: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(seed)
    common = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=1024, initializer_range=0.2, bos_token_id=1,
                  eos_token_id=2)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=True, **common))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(tie_word_embeddings=False, **common))
    model.save_pretrained(path)
    return path


# Tests of native CPU kernels that split their work over threads (at::parallel_for):
# they run on at least two threads even under xdist, so the split stays tested.
THREADED_KERNEL_TESTS = ("tests/kernels/test_cpu_", "tests/worker/test_fused_decode.py",
                         "tests/worker/test_linear", "tests/worker/test_invariant_linear.py",
                         "tests/worker/test_quantized_model.py")


@pytest.fixture(autouse=True)
def _torch_threads_restored(request):
    """Each test starts with torch's thread count as the session began with it: an
    in-process engine built with ``worker.num_threads: 1`` (the tensor-parallel tests)
    sets it for the whole process, and every later test would run on one thread.
    THREADED_KERNEL_TESTS get at least two."""
    import torch
    before = torch.get_num_threads()
    if request.node.nodeid.startswith(THREADED_KERNEL_TESTS) and before < 2:
        torch.set_num_threads(2)
    yield
    if torch.get_num_threads() != before:
        torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A randomly initialised 2-layer Llama checkpoint folder (tied embeddings)."""
    return _save_tiny(tmp_path_factory.mktemp("tiny_llama"), "llama", 0)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory):
    """A randomly initialised 2-layer Qwen2 checkpoint folder (q/k/v bias, untied head)."""
    return _save_tiny(tmp_path_factory.mktemp("tiny_qwen2"), "qwen2", 1)


@pytest.fixture(scope="session")
def perturbed_llama_dir(tiny_llama_dir, tmp_path_factory):
    """The tiny Llama with every weight nudged (a training step's worth of change), for
    the weight-update tests."""
    import shutil
    import torch
    from safetensors.torch import load_file, save_file
    folder = tmp_path_factory.mktemp("tiny_llama_perturbed")
    shutil.copytree(tiny_llama_dir, folder, dirs_exist_ok=True)
    weights = load_file(str(tiny_llama_dir / "model.safetensors"))
    gen = torch.Generator().manual_seed(11)
    nudged = {n: (t + 0.05 * torch.randn(t.shape, generator=gen)).contiguous()
              for n, t in weights.items()}
    save_file(nudged, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="session")
def tiny_llama_draft_dir(tiny_llama_dir, default_model_path, tmp_path_factory):
    """The tiny Llama as a speculative-decoding draft of itself: a copy that ships the
    default model's tokenizer.json (a draft must come with the model's tokenizer)."""
    import shutil
    from text.tokenizer import Tokenizer
    folder = tmp_path_factory.mktemp("tiny_llama_draft")
    shutil.copytree(tiny_llama_dir, folder, dirs_exist_ok=True)
    Tokenizer.from_model_path(default_model_path).backend.save(str(folder / "tokenizer.json"))
    return folder


@pytest.fixture(scope="session")
def default_model_path():
    from model_files.paths import resolve_model_path
    return resolve_model_path("default")


@pytest.fixture
def make_tiny_llm(tiny_llama_dir, default_model_path):
    """Build an LLM on the tiny Llama with the default model's tokenizer."""
    from folio import LLM

    def make(**overrides):
        kw = dict(model=str(tiny_llama_dir), tokenizer=str(default_model_path),
                  dtype="float32", max_model_len=512, num_blocks=256, block_size=16)
        kw.update(overrides)
        kw.setdefault("observability.log_level", "warning")
        return LLM(**kw)
    return make



@pytest.fixture(scope="session")
def smollm_tokenizer():
    """The default model's tokenizer, rebuilt by Folio from the GGUF."""
    from text.tokenizer import Tokenizer
    return Tokenizer.from_model_path("default")


# Three PEFT LoRA adapters of the tiny Llama (tests/lora_adapters.py): ranks, alphas,
# target sets and rsLoRA differ, so each one exercises another part of the slots.
TINY_ADAPTERS = {
    "qv8": dict(rank=8, alpha=16, targets=("q_proj", "v_proj"), seed=1, scale=4.0),
    "all16": dict(rank=16, alpha=8, targets=("q_proj", "k_proj", "v_proj", "o_proj",
                                              "gate_proj", "up_proj", "down_proj"),
                  use_rslora=True, seed=2),
    "mlp4": dict(rank=4, alpha=8, targets=("o_proj", "gate_proj", "up_proj", "down_proj"),
                 seed=3, scale=4.0),
    "qkvo8": dict(rank=8, alpha=8, targets=("q_proj", "k_proj", "v_proj", "o_proj"),
                  seed=4, scale=4.0),
}


@pytest.fixture(scope="session")
def tiny_lora_adapters(tiny_llama_dir, tmp_path_factory):
    """name → folder of each TINY_ADAPTERS adapter, saved by peft's save_pretrained."""
    from tests.lora_adapters import AdapterSpec, load_base, make_adapter
    base = load_base(tiny_llama_dir)
    root = tmp_path_factory.mktemp("tiny_lora")
    return {name: make_adapter(base, root / name, AdapterSpec(**spec))
            for name, spec in TINY_ADAPTERS.items()}


# End-to-end modules, marked `slow` as a whole: they start `folio serve` stacks, spawn
# ranks or load the real default model. `pytest -m "not slow"` leaves them out for a
# quick local run; CI runs everything.
SLOW_MODULE_MARKS = ("_e2e.py", "default_model.py", "test_serve_", "test_docker_compose.py",
                     "test_client_libraries.py", "test_tensor_parallel")


def _streams_the_default_model(item) -> bool:
    """A test that runs the real default model for many steps: memory-bound on a CPU."""
    return item.path.name.endswith("default_model.py") or "default_model" in item.name


def pytest_collection_modifyitems(config, items):
    for item in items:
        name = item.path.name
        if any(mark in name for mark in SLOW_MODULE_MARKS):
            item.add_marker(pytest.mark.slow)
    # The default model's tests (about seven minutes in all on two cores) run first.
    # Under the README's `-n 2 --dist worksteal` one worker starts on them while the
    # other takes the rest, mostly single-threaded Python and process start-ups, which
    # share two cores with them well; run last, they would be the run's long tail.
    items.sort(key=lambda item: not _streams_the_default_model(item))  # stable
