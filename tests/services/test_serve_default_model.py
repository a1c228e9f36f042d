"""`folio serve` on the real default model: greedy answers over HTTP equal the offline
``LLM`` on the same prompts, for chat and for completions."""
import asyncio

import openai

from engine_core.sampling_params import SamplingParams
from tests.services.serve_process import serving_default_model

SETTINGS = dict(dtype="float32", max_model_len=1024)
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.",
             "List three prime numbers."]
PROMPTS = ["The three primary colours are", "def add(a, b):\n"]


def test_default_model_greedy_over_http_equals_offline(tmp_path):
    from folio import LLM
    llm = LLM(model="default", kv_cache_bytes=64 * 1024 ** 2, **SETTINGS)
    greedy = SamplingParams(max_tokens=24, temperature=0.0)
    chats = [llm.chat([{"role": "user", "content": q}], greedy, use_tqdm=False)[0]
             .outputs[0].text for q in QUESTIONS]
    completions = [o.outputs[0].text for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
    del llm

    with serving_default_model(tmp_path, **SETTINGS) as serve:

        async def main():
            c = openai.AsyncOpenAI(base_url=serve.url + "/v1", api_key="none")
            model = (await c.models.list()).data[0].id
            assert model == "SmolLM2-135M-Instruct"
            chat = await asyncio.gather(*(c.chat.completions.create(
                model=model, messages=[{"role": "user", "content": q}], max_tokens=24,
                temperature=0) for q in QUESTIONS))
            assert [r.choices[0].message.content for r in chat] == chats
            done = await asyncio.gather(*(c.completions.create(
                model=model, prompt=p, max_tokens=24, temperature=0) for p in PROMPTS))
            assert [r.choices[0].text for r in done] == completions
            assert "Paris" in chats[0]
        asyncio.run(main())
