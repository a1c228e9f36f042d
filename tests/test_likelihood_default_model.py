"""Issue 18, the likelihood check: on the default model in float32, the summed prompt
logprobs of 5 texts are the same three ways, within 1e-3: ``echo`` + ``logprobs`` +
``max_tokens: 0`` over HTTP (what lm-eval's loglikelihood tasks send), the offline
``LLM``'s ``prompt_logprobs``, and Hugging Face transformers' teacher-forced
log-likelihood of the same token ids (transformers loads the same GGUF itself).
Folio dequantises the GGUF too (``quantization: none``), offline and served, as
transformers does: the comparison is of the engine, not of a weight format."""
from __future__ import annotations

import asyncio

import openai
import pytest
import torch

from engine_core.sampling_params import SamplingParams
from tests.services.serve_process import serving_default_model

SETTINGS = dict(dtype="float32", max_model_len=1024, quantization="none")
TEXTS = ["The capital of France is Paris.",
         "def add(a, b):\n    return a + b\n",
         "Once upon a time, there lived an old fisherman who",
         "1, 2, 3, 5, 8, 13, 21, 34",
         "Q: What is 17 times 23?\nA: 391"]


def test_echo_offline_and_transformers_agree_on_log_likelihood(default_model_path,
                                                                tmp_path):
    from transformers import AutoModelForCausalLM

    from folio import LLM
    llm = LLM(model="default", kv_cache_bytes=64 * 1024 ** 2, **SETTINGS)
    outs = llm.generate(TEXTS, SamplingParams(max_tokens=1, prompt_logprobs=0),
                        use_tqdm=False)
    ids = [o.prompt_token_ids for o in outs]
    offline = [sum(o.prompt_logprobs[i][t].logprob for i, t in enumerate(o.prompt_token_ids)
                   if i > 0) for o in outs]
    del llm

    hf = AutoModelForCausalLM.from_pretrained(
        default_model_path.parent, gguf_file=default_model_path.name,
        dtype=torch.float32).eval()
    reference = []
    with torch.no_grad():
        for row in ids:
            logprobs = hf(torch.tensor([row])).logits[0].float().log_softmax(-1)
            reference.append(float(logprobs[:-1].gather(-1, torch.tensor(row[1:])[:, None])
                                   .sum()))
    del hf

    with serving_default_model(tmp_path, **SETTINGS) as serve:

        async def main():
            c = openai.AsyncOpenAI(base_url=serve.url + "/v1", api_key="none")
            model = (await c.models.list()).data[0].id
            return await c.completions.create(model=model, prompt=TEXTS, echo=True,
                                              logprobs=0, max_tokens=0)
        r = asyncio.run(main())
    echoed = [sum(c.logprobs.token_logprobs[1:]) for c in r.choices]
    assert [len(c.logprobs.tokens) for c in r.choices] == [len(row) for row in ids]
    assert [c.text for c in r.choices] == TEXTS
    assert echoed == pytest.approx(offline, abs=1e-3)
    assert offline == pytest.approx(reference, abs=1e-3)
