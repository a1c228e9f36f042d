"""Parity with transformers on tiny random Llama and Qwen2 (q/k/v bias) checkpoints."""
import random

import pytest
import torch

from engine_core.sampling_params import SamplingParams


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_greedy_tokens_match_transformers(kind, request, default_model_path):
    from transformers import AutoModelForCausalLM

    from folio import LLM
    path = request.getfixturevalue(f"tiny_{kind}_dir")
    llm = LLM(model=str(path), tokenizer=str(default_model_path), dtype="float32",
              max_model_len=256, num_blocks=128, max_num_batched_tokens=32,
              **{"observability.log_level": "warning"})
    assert llm.runner.arch.attention_bias == (kind == "qwen2")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in (1, 7, 40, 90)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                        use_tqdm=False)
    with torch.inference_mode():
        for p, out in zip(prompts, outs):
            ref = hf.generate(torch.tensor([p]), max_new_tokens=16, min_new_tokens=16,
                              do_sample=False, pad_token_id=0)[0, len(p):]
            assert out.outputs[0].token_ids == ref.tolist()
            # first-token logprobs agree with transformers' logits
        p = prompts[2]
        first = llm.generate({"prompt_token_ids": p},
                             SamplingParams(temperature=0.0, max_tokens=1, logprobs=5),
                             use_tqdm=False)[0].outputs[0].logprobs[0]
        ref = hf(torch.tensor([p])).logits[0, -1].log_softmax(-1)
        top = ref.topk(5)
        assert list(first) == top.indices.tolist()  # vLLM's {token_id: Logprob}, by rank
        torch.testing.assert_close(torch.tensor([e.logprob for e in first.values()]),
                                   top.values, atol=1e-4, rtol=1e-4)
