"""Speculative decoding on the default model in float32: greedy outputs with n-gram and
with draft_model (the model as its own draft) equal those without speculation, token
for token, over 10 chat prompts (5 copy-heavy: repeat, fix, quote; 5 free-form), 64
tokens, alone and in a batch of 16 with chunked prefill and a forced preemption; and
seeded sampling with n-gram drafts draws exactly the tokens it draws without them.

The GGUF is dequantised (``quantization: none``): token-for-token equality needs each
row's result not to depend on how many rows share the step, and the quantized weights'
linear backends are chosen per row count (worker/linear_backend.py), so a verify step
of k + 1 rows may take another path, summing in another order, than a one-row decode
step. Those paths are not batch-invariant; float32 ``F.linear`` is, here."""
import pytest

from engine_core.sampling_params import SamplingParams
from folio.bench.spec_prompts import chat_messages, copy_messages

GREEDY = SamplingParams(temperature=0.0, max_tokens=64)
SEEDED = [SamplingParams(temperature=0.7, top_p=0.95, seed=100 + i, max_tokens=32)
          for i in range(2)]
# 16 requests of up to ~200 tokens (13 blocks each) in 63 usable blocks: preemption is
# forced; a 48-token budget chunks every prompt.
BATCH = dict(num_blocks=64, max_num_batched_tokens=48)


def tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def make_llm(**kw):
    from folio import LLM
    return LLM(dtype="float32", max_model_len=512, quantization="none",
               **{"observability.log_level": "warning"}, **kw)


@pytest.fixture(scope="module")
def prompts():
    from text.tokenizer import Tokenizer
    tokenizer = Tokenizer.from_model_path("default")
    conversations = copy_messages(max_chars=400) + chat_messages()
    return [{"prompt_token_ids": tokenizer.encode_chat(
        tokenizer.render_chat(c, True, split_content=True))} for c in conversations]


@pytest.fixture(scope="module")
def reference(prompts):
    """Without speculation: greedy (in one batch: greedy tokens without drafts do not
    depend on the batch, tests/test_consistency.py) and seeded on two copy prompts."""
    llm = make_llm(num_blocks=256)
    return (tokens(llm.generate(prompts, GREEDY, use_tqdm=False)),
            tokens(llm.generate(prompts[:2], SEEDED, use_tqdm=False)))


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_greedy_outputs_equal_those_without_speculation(prompts, reference, method):
    greedy, seeded = reference
    llm = make_llm(**BATCH, speculative_method=method, speculative_draft_model="default")
    alone = [tokens(llm.generate(p, GREEDY, use_tqdm=False))[0] for p in prompts]
    assert alone == greedy
    stats = llm.engine.get_stats().spec_decode
    # drafts were verified and accepted on the copy-heavy prompts: adaptive k starts
    # each request at k = 1, and about half of their tokens come from drafts (49% here)
    assert stats.num_accepted_tokens > 0.4 * sum(map(len, greedy[:5]))
    batch = tokens(llm.generate(prompts + prompts[:6], GREEDY, use_tqdm=False))
    assert batch[:10] == greedy and batch[10:] == greedy[:6]
    assert llm.engine.num_preemptions > 0
    kv = llm.engine.scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.block_pool.num_blocks - 1
    if method == "ngram":  # seeded sampling: n-gram drafts change no token
        before = llm.engine.get_stats().spec_decode.num_accepted_tokens
        assert tokens(llm.generate(prompts[:2], SEEDED, use_tqdm=False)) == seeded
        assert llm.engine.get_stats().spec_decode.num_accepted_tokens > before + 10
