"""Speculative decoding on the default model in float32: greedy outputs with n-gram and
with draft_model (the model as its own draft) equal those without speculation, token
for token, over 10 chat prompts (5 copy-heavy: repeat, fix, quote; 5 free-form), 64
tokens, alone and in a batch of 16 with chunked prefill and a forced preemption; and
seeded sampling with n-gram drafts draws exactly the tokens it draws without them."""
import pytest

from engine_core.sampling_params import SamplingParams
from folio.bench.spec_prompts import chat_messages, copy_messages

GREEDY = SamplingParams(temperature=0.0, max_tokens=64)


def tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def make_llm(**kw):
    from folio import LLM
    return LLM(dtype="float32", max_model_len=512, **{"observability.log_level": "warning"},
               **kw)


@pytest.fixture(scope="module")
def prompts():
    from text.tokenizer import Tokenizer
    tokenizer = Tokenizer.from_model_path("default")
    conversations = copy_messages(max_chars=500) + chat_messages()
    return [{"prompt_token_ids": tokenizer.encode_chat(
        tokenizer.render_chat(c, True, split_content=True))} for c in conversations]


@pytest.fixture(scope="module")
def reference(prompts):
    # In one batch: greedy tokens without speculation do not depend on the batch
    # (tests/test_consistency.py), and one batch is ten times fewer steps.
    return tokens(make_llm(num_blocks=256).generate(prompts, GREEDY, use_tqdm=False))


# 16 requests of up to ~250 tokens (16 blocks each) in 63 usable blocks: preemption is forced; a
# 48-token budget chunks every prompt.
BATCH = dict(num_blocks=64, max_num_batched_tokens=48)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_greedy_outputs_equal_those_without_speculation(prompts, reference, method):
    llm = make_llm(**BATCH, speculative_method=method, speculative_draft_model="default")
    alone = [tokens(llm.generate(p, GREEDY, use_tqdm=False))[0] for p in prompts]
    assert alone == reference
    stats = llm.engine.get_stats().spec_decode
    # drafts were verified and mostly accepted on the copy-heavy prompts
    assert stats.num_accepted_tokens > 0.5 * sum(map(len, reference[:5]))
    batch = tokens(llm.generate(prompts + prompts[:6], GREEDY, use_tqdm=False))
    assert batch[:10] == reference and batch[10:] == reference[:6]
    assert llm.engine.num_preemptions > 0
    kv = llm.engine.scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.block_pool.num_blocks - 1


def test_seeded_sampling_with_ngram_drafts_draws_the_same_tokens(prompts):
    params = [SamplingParams(temperature=0.7, top_p=0.95, seed=100 + i, max_tokens=48)
              for i in range(2)]
    plain = tokens(make_llm(num_blocks=64).generate(prompts[:2], params, use_tqdm=False))
    llm = make_llm(num_blocks=64, speculative_method="ngram")
    assert tokens(llm.generate(prompts[:2], params, use_tqdm=False)) == plain
    assert llm.engine.get_stats().spec_decode.num_accepted_tokens > 10
