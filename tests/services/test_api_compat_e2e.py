"""Issue 18 end to end: vLLM's OpenAI-server requests (completion, echo, logprobs,
prompt_logprobs, batched prompts, vLLM's extensions) against a real `folio serve` on
the tiny Llama, with the official ``openai`` client where it can send them (vLLM's own
tests do the same; model-specific strings are replaced by checks against the offline
``LLM`` on the same checkpoint).
"""
from __future__ import annotations

import asyncio

import openai
import pytest

from engine_core.sampling_params import SamplingParams
from tests.services.serve_process import running, write_config

MODEL = "folio-tiny"
TEXTS = ["Hello, my name is", "The capital of France is", "1 + 1 = 2, 2 + 2 ="]


@pytest.fixture(scope="module")
def stack(tiny_llama_dir, default_model_path, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("compat_stack")
    config = write_config(tmp / "folio.yaml", str(tiny_llama_dir), str(default_model_path),
                          cache={"enable_prefix_caching": True})
    with running(config, tmp) as serve:
        yield serve


@pytest.fixture(scope="module")
def offline(tiny_llama_dir, default_model_path):
    """The offline LLM on the stack's checkpoint and settings."""
    from folio import LLM
    return LLM(model=str(tiny_llama_dir), tokenizer=str(default_model_path),
               dtype="float32", max_model_len=1024, num_blocks=256, block_size=16,
               **{"observability.log_level": "warning"})


def client(stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="none", max_retries=0)


def _check_offsets(choice, num_prompt_tokens):
    lp = choice.logprobs
    offsets, text = lp.text_offset, choice.text
    assert len(offsets) == len(lp.tokens) and offsets == sorted(offsets)
    # ASCII prompts: each prompt token is its own text (a random model's sampled token
    # may be special or half a character, so only its start is checked)
    for i, token in enumerate(lp.tokens[:num_prompt_tokens]):
        end = offsets[i + 1] if i + 1 < len(offsets) else len(text)
        assert text[offsets[i]:end] == token, (i, token)


def test_batched_echo_with_logprobs_max_tokens_0_and_1(stack, offline):
    async def main():
        c = client(stack)
        for max_tokens in (0, 1):
            r = await c.completions.create(model=MODEL, prompt=TEXTS, echo=True, logprobs=1,
                                           max_tokens=max_tokens, temperature=0)
            assert [ch.index for ch in r.choices] == [0, 1, 2]
            prompt_tokens = 0
            for text, choice in zip(TEXTS, r.choices):
                assert choice.text.startswith(text)
                ids = offline.get_tokenizer().encode(text)
                prompt_tokens += len(ids)
                lp = choice.logprobs
                assert len(lp.tokens) == len(ids) + max_tokens
                assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
                assert all(v <= 0 for v in lp.token_logprobs[1:])
                assert all(len(top) >= 1 for top in lp.top_logprobs[1:])
                if max_tokens == 0:
                    assert choice.text == text and choice.finish_reason == "length"
                _check_offsets(choice, len(ids))
            assert r.usage.prompt_tokens == prompt_tokens
            assert r.usage.completion_tokens == 3 * max_tokens
    asyncio.run(main())


def test_echo_prompt_logprobs_equal_the_offline_llm(stack, offline):
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    want = offline.generate(TEXTS, params, use_tqdm=False)

    async def main():
        c = client(stack)
        r = await c.completions.create(model=MODEL, prompt=TEXTS, echo=True, logprobs=0,
                                       max_tokens=0)
        p = await c.completions.create(model=MODEL, prompt=TEXTS[1], max_tokens=1,
                                       extra_body={"prompt_logprobs": 2})
        return r, p
    echoed, asked = asyncio.run(main())
    for choice, out in zip(echoed.choices, want):
        ids = out.prompt_token_ids
        offline_lps = [out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))]
        assert choice.logprobs.token_logprobs[1:] == pytest.approx(offline_lps, abs=1e-4)
    served = asked.choices[0].model_extra["prompt_logprobs"]
    ids = want[1].prompt_token_ids
    assert served[0] is None and len(served) == len(ids)
    for i in range(1, len(ids)):
        entry = served[i][str(ids[i])]
        assert entry["logprob"] == pytest.approx(
            want[1].prompt_logprobs[i][ids[i]].logprob, abs=1e-4)
        assert 1 <= len(served[i]) <= 3


def test_batch_with_n_2_orders_choices_prompt_major_like_the_offline_llm(stack, offline):
    ids = [offline.get_tokenizer().encode(t) for t in TEXTS]
    params = SamplingParams(n=2, max_tokens=4, temperature=0)
    want = offline.generate([{"prompt_token_ids": i} for i in ids], params, use_tqdm=False)

    async def main():
        c = client(stack)
        r = await c.completions.create(model=MODEL, prompt=ids, n=2, max_tokens=4,
                                       temperature=0)
        stream = await c.completions.create(model=MODEL, prompt=TEXTS, n=2, max_tokens=4,
                                            temperature=0, stream=True)
        texts: dict[int, str] = {}
        async for chunk in stream:
            for ch in chunk.choices:
                texts[ch.index] = texts.get(ch.index, "") + ch.text
        return r, texts
    r, streamed = asyncio.run(main())
    expected = [c.text for out in want for c in out.outputs]
    assert [c.index for c in r.choices] == list(range(6))
    assert [c.text for c in r.choices] == expected
    assert [streamed[i] for i in range(6)] == expected


def test_logprobs_0_includes_the_sampled_token_and_tokens_as_ids(stack):
    async def main():
        c = client(stack)
        r = await c.completions.create(model=MODEL, prompt=TEXTS[0], max_tokens=3,
                                       logprobs=0, temperature=0, extra_body={
                                           "return_token_ids": True,
                                           "return_tokens_as_token_ids": True})
        choice = r.choices[0]
        extra = choice.model_extra
        assert len(extra["token_ids"]) == 3 and len(extra["prompt_token_ids"]) > 1
        assert choice.logprobs.tokens == [f"token_id:{t}" for t in extra["token_ids"]]
        for token, top, lp in zip(choice.logprobs.tokens, choice.logprobs.top_logprobs,
                                  choice.logprobs.token_logprobs):
            assert top == {token: lp}
    asyncio.run(main())


def test_logit_bias_forces_and_bans_a_token(stack):
    async def main():
        c = client(stack)
        forced = await c.completions.create(model=MODEL, prompt=TEXTS[0], max_tokens=4,
                                            temperature=0, logit_bias={"1234": 100},
                                            extra_body={"return_token_ids": True})
        assert forced.choices[0].model_extra["token_ids"] == [1234] * 4
        plain = await c.completions.create(model=MODEL, prompt=TEXTS[0], max_tokens=1,
                                           temperature=0, extra_body={
                                               "return_token_ids": True})
        top = plain.choices[0].model_extra["token_ids"][0]
        banned = await c.completions.create(model=MODEL, prompt=TEXTS[0], max_tokens=1,
                                            temperature=0, logit_bias={str(top): -100},
                                            extra_body={"return_token_ids": True})
        assert banned.choices[0].model_extra["token_ids"][0] != top
        with pytest.raises(openai.BadRequestError) as e:
            await c.completions.create(model=MODEL, prompt="x", logit_bias={"49152": 1})
        assert "49152" in str(e.value) and "vocabulary" in str(e.value)
    asyncio.run(main())
