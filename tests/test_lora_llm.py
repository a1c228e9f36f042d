"""Multi-LoRA through the offline LLM on the tiny Llama: parity with peft's PeftModel,
mixed batches, max_loras and max_cpu_loras at work, and prefix caching per adapter."""
import random

import pytest
import torch

from engine_core.sampling_params import SamplingParams
from folio import LoRARequest
from tests.conftest import TINY_ADAPTERS
from tests.test_parity_default_model import LOGIT_ATOL, prefill_logits

NAMES = list(TINY_ADAPTERS)
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
SHORT = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)  # mixing tests


@pytest.fixture(scope="module")
def requests_of(tiny_lora_adapters):
    """name → LoRARequest (ids 1..4 in TINY_ADAPTERS order)."""
    return {n: LoRARequest(n, i + 1, str(tiny_lora_adapters[n])) for i, n in enumerate(NAMES)}


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(0)
    return [[rng.randrange(3, 49152) for _ in range(n)] for n in (1, 5, 9, 17, 33, 40, 64, 90)]


@pytest.fixture(scope="module")
def llm(make_tiny_llm_module):
    return make_tiny_llm_module(enable_lora=True, max_loras=4)


@pytest.fixture(scope="module")
def make_tiny_llm_module(tiny_llama_dir, default_model_path):
    from folio import LLM

    def make(**overrides):
        kw = dict(model=str(tiny_llama_dir), tokenizer=str(default_model_path),
                  dtype="float32", max_model_len=512, num_blocks=256, block_size=16,
                  max_num_batched_tokens=64, **{"observability.log_level": "warning"})
        return LLM(**{**kw, **overrides})
    return make


def generate(llm, prompts, lora, params=GREEDY):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                        lora_request=lora)
    return [o.outputs[0].token_ids for o in outs]


class Alone(dict):
    """(adapter or None, prompt index) → SHORT tokens of that request run by itself."""

    def __init__(self, llm, prompts, requests_of):
        super().__init__()
        self.llm, self.prompts, self.requests_of = llm, prompts, requests_of

    def __missing__(self, key):
        name, i = key
        lora = self.requests_of[name] if name else None
        self[key] = generate(self.llm, [self.prompts[i]], lora, SHORT)[0]
        return self[key]


@pytest.fixture(scope="module")
def alone(llm, prompts, requests_of):
    return Alone(llm, prompts, requests_of)


@pytest.mark.parametrize("name", NAMES[:3])
def test_greedy_tokens_and_prefill_logits_match_peft(llm, prompts, requests_of, name,
                                                     tiny_llama_dir, tiny_lora_adapters):
    from peft import PeftModel

    from tests.lora_adapters import load_base
    ours = generate(llm, prompts, requests_of[name])
    peft = PeftModel.from_pretrained(load_base(tiny_llama_dir), tiny_lora_adapters[name]).eval()
    width = max(map(len, prompts))  # one left-padded batch: 32 steps, not 8 x 32
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        ref = peft.generate(ids, attention_mask=mask, max_new_tokens=32, min_new_tokens=32,
                            do_sample=False, pad_token_id=0)[:, width:]
        assert ours == ref.tolist()
        for prompt in prompts[4::2]:
            logits = prefill_logits(llm.runner, prompt, requests_of[name].lora_int_id)
            ref = peft(torch.tensor([prompt])).logits[0]
            assert (logits - ref).abs().max().item() < LOGIT_ATOL


def test_the_adapters_change_the_output(alone):
    for i in (1, 6):
        assert len({tuple(alone[(n, i)]) for n in [None, *NAMES]}) == len(NAMES) + 1


def test_a_mixed_batch_equals_each_request_alone(llm, prompts, requests_of, alone):
    # 16 requests interleaving three adapters and the base model, one generate call,
    # prefills chunked (64-token budget) among decodes
    order = [(NAMES[i % 4] if i % 4 < 3 else None, i % len(prompts)) for i in range(16)]
    got = generate(llm, [prompts[i] for _, i in order],
                   [requests_of[n] if n else None for n, _ in order], SHORT)
    assert got == [alone[key] for key in order]


def test_max_loras_2_with_4_adapters_in_flight(make_tiny_llm_module, prompts, requests_of,
                                               alone):
    from observability.lora_metrics import LoRAMetrics
    from prometheus_client import CollectorRegistry, generate_latest
    llm = make_tiny_llm_module(enable_lora=True, max_loras=2)
    registry = CollectorRegistry()
    metrics, seen = LoRAMetrics(registry, 2), []
    step = llm.engine.step

    def observed_step():
        outputs = step()
        stats = llm.engine.get_stats().lora
        metrics.update(stats)
        seen.append((stats, generate_latest(registry).decode()))
        return outputs
    llm.engine.step = observed_step
    order = [(NAMES[i % 4], i % len(prompts)) for i in range(8)]
    got = generate(llm, [prompts[i] for _, i in order], [requests_of[n] for n, _ in order],
                   SHORT)
    assert got == [alone[key] for key in order]
    assert max(len(s.running) for s, _ in seen) == 2
    waiting = [(s, text) for s, text in seen if set(s.waiting) - set(s.running)
               and len(s.running) == 2]
    assert waiting, "no step showed an adapter waiting for a slot"
    stats, text = waiting[0]
    assert f'waiting_lora_adapters="{",".join(stats.waiting)}"' in text
    assert 'max_lora="2"' in text and f'running_lora_adapters="{",".join(stats.running)}"' in text


def test_max_cpu_loras_2_with_4_adapters_in_turn(make_tiny_llm_module, prompts, requests_of,
                                                 alone):
    llm = make_tiny_llm_module(enable_lora=True, max_loras=2, max_cpu_loras=2)
    for name in [*NAMES, NAMES[0]]:
        assert generate(llm, prompts[:2], requests_of[name], SHORT) == \
            [alone[(name, i)] for i in range(2)]
    registry = llm.engine.lora.registry
    assert registry.num_evictions >= 3 and len(llm.runner.lora.cache) <= 2
    assert registry.num_loads == 5  # the first adapter was evicted, then loaded again


def test_prefix_cache_never_serves_one_adapters_blocks_to_another(llm, requests_of):
    prompt = [random.Random(7).randrange(3, 49152) for _ in range(90)]  # 5 full blocks
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    def run(lora):
        out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False,
                           lora_request=lora)[0]
        return out.num_cached_tokens, out.outputs[0].token_ids
    a, b = requests_of[NAMES[0]], requests_of[NAMES[1]]
    cached_a, tokens_a = run(a)
    assert cached_a == 0
    assert run(a) == (80, tokens_a)  # its own blocks: a hit, the same tokens
    cached_b, tokens_b = run(b)
    cached_base, tokens_base = run(None)
    assert (cached_b, cached_base) == (0, 0)  # never adapter A's blocks
    assert len({tuple(tokens_a), tuple(tokens_b), tuple(tokens_base)}) == 3
    assert run(b) == (80, tokens_b) and run(None) == (80, tokens_base)


def test_steps_without_adapter_rows_skip_lora(llm, prompts, requests_of, monkeypatch):
    import worker.lora.lora_step as lora_step
    calls = []
    shrink = lora_step.lora_shrink
    monkeypatch.setattr(lora_step, "lora_shrink", lambda *a: calls.append(1) or shrink(*a))
    assert llm.runner.lora.prepare_step([0, 0], [0, 3, 4]) is None
    generate(llm, prompts[:2], None, SamplingParams(temperature=0.0, max_tokens=4))
    assert calls == []
    generate(llm, prompts[:1], requests_of[NAMES[0]], SamplingParams(max_tokens=2))
    assert calls  # the same code path does run for adapter rows
