"""Issue 18: ``SamplingParams.prompt_logprobs`` gives ``RequestOutput.prompt_logprobs``
in vLLM's shape, equal to Hugging Face's teacher-forced log-softmax of the same
checkpoint, whatever the chunking, with prefix caching on and for n > 1."""
from __future__ import annotations

import pytest
import torch

from engine_core.sampling_params import InvalidRequestError, SamplingParams
from text.logprob import Logprob

PROMPT = list(range(300, 340)) + [7, 7, 9, 1000, 2000, 5, 6]  # 47 tokens


@pytest.fixture(scope="module")
def hf_logprobs(tiny_llama_dir):
    from transformers import LlamaForCausalLM
    model = LlamaForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0].float()
    return logits.log_softmax(-1)


def _check(out, ref, k):
    lps = out.prompt_logprobs
    assert len(lps) == len(PROMPT) and lps[0] is None
    for pos, entry in enumerate(lps[1:], start=1):
        token, row = PROMPT[pos], ref[pos - 1]
        assert isinstance(entry[token], Logprob)
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
        lp = row[token].item()  # rank up to ties within float error between the two
        assert int((row > lp + 1e-4).sum()) + 1 <= entry[token].rank <= int(
            (row > lp - 1e-4).sum()) + 1
        top = row.topk(k).indices.tolist()
        assert set(top) <= set(entry) and len(entry) <= k + 1
        assert [entry[t].rank for t in top] == list(range(1, k + 1))


def test_prompt_logprobs_match_teacher_forcing_chunked_cached_and_n2(make_tiny_llm,
                                                                     hf_logprobs):
    llm = make_tiny_llm(max_num_batched_tokens=16, enable_prefix_caching=True)
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3)
    first, again = llm.generate([{"prompt_token_ids": PROMPT}] * 2, params, use_tqdm=False)
    _check(first, hf_logprobs, 3)
    _check(again, hf_logprobs, 3)
    (cached,) = llm.generate(prompt_token_ids=PROMPT, sampling_params=params)
    _check(cached, hf_logprobs, 3)  # a prefix-cache hit is not used for prompt logprobs
    (two,) = llm.generate(prompt_token_ids=[PROMPT],
                          sampling_params=SamplingParams(n=2, max_tokens=2, prompt_logprobs=0))
    assert len(two.outputs) == 2
    _check(two, hf_logprobs, 0)
    (plain,) = llm.generate(prompt_token_ids=PROMPT, sampling_params=SamplingParams(
        max_tokens=1))
    assert plain.prompt_logprobs is None


def test_prompt_logprobs_out_of_range_is_refused():
    for bad in (-1, 21, 1.5):
        with pytest.raises(InvalidRequestError) as e:
            SamplingParams(prompt_logprobs=bad)
        assert e.value.param == "prompt_logprobs"
