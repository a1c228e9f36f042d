"""Issue 17, worker side: masks touch only constrained rows, a step without them pays
nothing, a request waits for its grammar (deferred) without holding the batch, and a
sample's matcher accepts, validates (drafts), rolls back and replays (preemption).
End-to-end runs are in tests/test_structured_output.py."""
import threading
from concurrent.futures import Future

import numpy as np
import pytest
import torch

from engine_core.structured_outputs import StructuredOutputsParams
from engine_core.worker_sampling import WorkerSamplingParams
from text.grammar_compiler import GrammarError, allocate_bitmask
from worker.request_state import CachedRequestState
from worker.structured_output import StructuredOutputManager
from worker.structured_output.grammar_step import disallowed_tokens, mask_rows
from worker.structured_output.request_grammar import RequestGrammar

VOCAB = 49152
EOS = (2,)
CHOICE = StructuredOutputsParams(choice=["alpha", "beta"])
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}},
          "required": ["name"], "additionalProperties": False}


@pytest.fixture(scope="module")
def manager(smollm_tokenizer):
    m = StructuredOutputManager(VOCAB, EOS)
    m.use_tokenizer(smollm_tokenizer, EOS)
    return m


def state(req_id: str, grammar=None, outputs=()) -> CachedRequestState:
    params = WorkerSamplingParams(grammar=grammar.spec if grammar is not None else None)
    return CachedRequestState(req_id, [5, 6, *outputs], 2, params, [1], 2, None)


def test_masks_touch_only_constrained_rows_and_free_steps_pay_nothing(manager):
    states = [state("free0"), state("c", CHOICE), state("free1")]
    assert manager.begin_step([states[0], states[2]]) is None
    manager.validate(CHOICE.spec)
    step = manager.begin_step(states)
    logits = torch.randn(3, VOCAB)
    before = logits.clone()
    out, kept = step.apply(logits, states)
    assert kept == states and torch.equal(out[0], before[0]) and torch.equal(out[2], before[2])
    allowed = torch.isfinite(out[1]).nonzero().flatten().tolist()
    texts = {manager.compiler.tokenizer.decode([t]) for t in allowed}
    assert texts and all("alpha".startswith(t) or "beta".startswith(t) for t in texts)
    token = allowed[0]
    step.accept([[11], [token], [12]])  # only the constrained row's matcher moves
    assert states[1].grammar.validate([token]) == 0 or len(allowed) > 1


def test_the_bitmask_unpacks_to_the_tokens_it_names():
    words = np.zeros((2, 3), dtype=np.int32)
    words[0, 0] = 1 << 5
    words[1, 2] = -(1 << 31)  # bit 31 of word 2: token 95
    banned = disallowed_tokens(words, 70)
    assert banned.shape == (2, 70)
    assert np.flatnonzero(~banned[0]).tolist() == [5]
    assert np.flatnonzero(~banned[1]).tolist() == []  # 95 lies past the 70 rows
    assert np.flatnonzero(~disallowed_tokens(words, 96)[1]).tolist() == [95]
    for logits in (torch.randn(3, 70), torch.randn(3, 70, dtype=torch.bfloat16)):
        before = logits.clone()
        mask_rows(logits, [2, 0], banned)  # the torch path serves other dtypes/devices
        assert torch.equal(logits[1], before[1])
        assert torch.isfinite(logits[2]).nonzero().flatten().tolist() == [5]
        assert torch.isinf(logits[0]).all()


def allowed(bitmask) -> list[int]:
    return np.flatnonzero(~disallowed_tokens(bitmask, VOCAB)[0]).tolist()


def test_a_request_still_compiling_is_deferred_without_holding_the_others(
        smollm_tokenizer):
    gate = threading.Event()
    slow = StructuredOutputManager(VOCAB, EOS)
    slow.use_tokenizer(smollm_tokenizer, EOS)
    compile_now = slow._compile
    slow.cache._compile = lambda spec: gate.wait(30) and compile_now(spec)
    states = [state("free"), state("c", CHOICE)]
    step = slow.begin_step(states)
    logits = torch.randn(2, VOCAB)
    out, kept = step.apply(logits, states)
    assert [s.req_id for s in kept] == ["free"] and out.shape == (1, VOCAB)
    assert slow.take_report(step).deferred_req_ids == ["c"]
    gate.set()
    slow.cache.get(CHOICE.spec).result(timeout=30)
    step = slow.begin_step(states)
    out, kept = step.apply(torch.randn(2, VOCAB), states)
    assert len(kept) == 2 and torch.isinf(out[1]).sum() > VOCAB - 100
    report = slow.take_report(step)
    assert report.deferred_req_ids == [] and len(report.compile_seconds) == 1


def test_request_grammar_accepts_validates_rolls_back_and_replays(manager,
                                                                  smollm_tokenizer):
    spec = StructuredOutputsParams(regex=r"[0-9]{2}-[0-9]{2}").spec
    manager.validate(spec)
    ids = smollm_tokenizer.encode("12-34", add_special_tokens=False)
    grammar = RequestGrammar("r", manager.cache.get(spec), [], EOS)
    assert grammar.is_ready and grammar.validate(ids + [7]) == len(ids)
    assert grammar.accept(ids[:2]) and not grammar.is_complete
    grammar.rollback(2)
    assert grammar.accept(ids) and grammar.is_complete
    assert grammar.accept([EOS[0]])  # EOS ends a complete output
    resumed = RequestGrammar("r", manager.cache.get(spec), ids[:3], EOS)
    assert resumed.is_ready and resumed.validate(ids[3:]) == len(ids) - 3
    bad = RequestGrammar("b", manager.cache.get(spec), [], EOS)
    assert bad.is_ready and not bad.accept(smollm_tokenizer.encode("x", False))
    bitmask = allocate_bitmask(1, VOCAB)
    failed = Future()
    failed.set_exception(GrammarError("no"))
    broken = RequestGrammar("f", failed, [], EOS)
    for g in (bad, broken):
        assert g.is_ready and g.failed
        g.fill(bitmask, 0)
        assert allowed(bitmask) == list(EOS)


def test_draft_masks_follow_the_accepted_drafts_and_leave_the_matcher(manager,
                                                                      smollm_tokenizer):
    spec = StructuredOutputsParams(choice=["cat", "car"]).spec
    manager.validate(spec)
    grammar = RequestGrammar("d", manager.cache.get(spec), [], EOS)
    assert grammar.is_ready
    c, a = (smollm_tokenizer.encode(x, add_special_tokens=False)[0] for x in ("c", "a"))
    wrong = smollm_tokenizer.encode("x", add_special_tokens=False)[0]
    bitmask = allocate_bitmask(4, VOCAB)
    assert grammar.fill_drafts(bitmask, 0, [c, a, wrong]) == 2
    assert c in allowed(bitmask[0:1]) and a in allowed(bitmask[1:2])
    texts = {smollm_tokenizer.decode([t]) for t in allowed(bitmask[2:3])}
    assert texts and texts <= {"t", "r"}
    assert len(allowed(bitmask[3:4])) == VOCAB  # past the rejected draft: untouched
    assert grammar.validate([c, a]) == 2  # the matcher is back at the start


def test_validate_raises_for_a_bad_grammar_and_caches_good_ones(manager):
    with pytest.raises(GrammarError):
        manager.validate(StructuredOutputsParams(regex="(unclosed").spec)
    with pytest.raises(GrammarError):  # the failed verdict is cached too
        manager.validate(StructuredOutputsParams(regex="(unclosed").spec)
    spec = StructuredOutputsParams(json=PERSON).spec
    manager.validate(spec)
    assert spec in manager.cache


def test_a_verify_step_leaves_each_matcher_advanced_by_exactly_the_emitted_tokens(
        manager, smollm_tokenizer):
    """Speculative decoding, one step through the real verifier (greedy): a draft the
    grammar bans is rejected at its own row and the grammar's token replaces it; a
    draft the grammar allows but the model does not is rejected as usual; the free
    request between them keeps its rows. Afterwards each matcher equals one that
    consumed only the emitted tokens, and rolling back over them reaches the start."""
    from worker.speculative_sampler import SpeculativeSampler
    spec = StructuredOutputsParams(regex=r"\d{2}-\d{2}").spec
    manager.validate(spec)
    one, two, three, seven, dash = (smollm_tokenizer.encode(x, add_special_tokens=False)[0]
                                    for x in ("1", "2", "3", "7", "-"))

    def greedy_state(req_id, grammar_spec, drafts):
        params = WorkerSamplingParams(temperature=0.0, grammar=grammar_spec)
        s = CachedRequestState(req_id, [5, 6], 2, params, [1], 2, None)
        s.spec_token_ids = list(drafts)
        return s
    states = [greedy_state("banned", spec, [one, two, seven]),  # 7 where "-" must come
              greedy_state("free", None, [one, two]),
              greedy_state("model", spec, [one, two])]  # the model wants 3, not 2
    logits = torch.randn(4 + 3 + 3, VOCAB)
    favour = {0: [one], 1: [two], 2: [seven, dash], 4: [one], 5: [seven], 7: [one],
              8: [three]}
    for row, tokens in favour.items():
        for rank, t in enumerate(tokens):
            logits[row, t] = 50.0 - rank  # seven first, dash second: the mask decides
    step = manager.begin_step(states)
    kept_logits, kept = step.apply(logits, states)
    assert kept == states
    tokens, _ = SpeculativeSampler(EOS)(kept_logits, kept)
    assert tokens == [[one, two, dash], [one, seven], [one, three]]
    step.accept(tokens)
    for s, emitted in ((states[0], [one, two, dash]), (states[2], [one, three])):
        fresh = RequestGrammar("fresh", manager.cache.get(spec), emitted, EOS)
        assert fresh.is_ready
        got, want = allocate_bitmask(1, VOCAB), allocate_bitmask(1, VOCAB)
        s.grammar.fill(got, 0)
        fresh.fill(want, 0)
        assert np.array_equal(got, want)
        s.grammar.rollback(len(emitted))
        start = RequestGrammar("start", manager.cache.get(spec), [], EOS)
        assert start.is_ready
        start.fill(want, 0)
        s.grammar.fill(got, 0)
        assert np.array_equal(got, want) and not s.grammar.failed


def test_an_eos_draft_is_a_no_op_for_the_matcher(manager, smollm_tokenizer):
    """EOS is never consumed (llguidance's rollback would count it only sometimes):
    the row after an accepted EOS draft carries the same mask, and ``accept`` skips it."""
    spec = StructuredOutputsParams(regex=r"\d+").spec
    manager.validate(spec)
    one, x = (smollm_tokenizer.encode(t, add_special_tokens=False)[0] for t in ("1", "x"))
    grammar = RequestGrammar("e", manager.cache.get(spec), [], EOS)
    assert grammar.is_ready
    bitmask = allocate_bitmask(4, VOCAB)
    assert grammar.fill_drafts(bitmask, 0, [one, EOS[0], x]) == 2
    assert EOS[0] not in allowed(bitmask[0:1]) and EOS[0] in allowed(bitmask[1:2])
    assert np.array_equal(bitmask[1], bitmask[2])  # after EOS: digits or EOS again
    assert x not in allowed(bitmask[2:3])
    assert grammar.accept([one, EOS[0], one]) and grammar.is_complete
    grammar.rollback(2)  # exactly two tokens were consumed
    assert grammar.validate([one]) == 1 and not grammar.is_complete


def test_only_a_first_eos_where_the_grammar_must_end_ends_the_sample(manager,
                                                                  smollm_tokenizer):
    """``ended_at_eos``: the first EOS of the emitted tokens came where the grammar was
    stopped (a regex of exactly two digits, after two); an EOS where it could go on
    (after one digit of \\d{1,2}, ignore_eos) does not end it, nor does a later one."""
    one = smollm_tokenizer.encode("1", add_special_tokens=False)[0]

    def grammar_for(regex: str) -> RequestGrammar:
        spec = StructuredOutputsParams(regex=regex).spec
        manager.validate(spec)
        g = RequestGrammar("g", manager.cache.get(spec), [], EOS)
        assert g.is_ready
        return g

    exact = grammar_for(r"\d\d")
    assert exact.accept([one, one, EOS[0], EOS[0]]) and exact.ended_at_eos
    assert exact.accept([EOS[0]]) and exact.ended_at_eos
    open_end = grammar_for(r"\d{1,2}")
    assert open_end.accept([one, EOS[0], one, EOS[0]]) and not open_end.ended_at_eos
    assert open_end.accept([EOS[0]]) and open_end.ended_at_eos  # now it must end
    plain = grammar_for(r"\d\d")
    plain.accept([one])
    assert not plain.ended_at_eos


def test_the_draft_guide_masks_each_pass_where_the_drafts_stand_then_rolls_back(
        manager, smollm_tokenizer):
    """Grammar-guided drafting: pass j's draft logits are masked at output + d1..dj
    (a free request's row untouched), and the matcher ends where it began."""
    from worker.structured_output.draft_guide import DraftGuide
    spec = StructuredOutputsParams(regex=r"\d{2}-\d{2}").spec
    manager.validate(spec)
    one, two, dash = (smollm_tokenizer.encode(x, add_special_tokens=False)[0]
                      for x in ("1", "2", "-"))
    states = [state("free"), state("c", StructuredOutputsParams(regex=r"\d{2}-\d{2}"))]
    states[1].grammar = RequestGrammar("c", manager.cache.get(spec), [], EOS)
    guide = DraftGuide(states, VOCAB)
    picked = []
    for j in range(3):
        logits = torch.randn(2, VOCAB)
        before = logits[0].clone()
        guide.mask(logits, [0, 1])
        assert torch.equal(logits[0], before)
        picked.append(int(logits[1].argmax()))
        guide.advance(1, picked[-1])
    texts = [smollm_tokenizer.decode([t]) for t in picked]
    assert texts[0].isdigit() and texts[1].isdigit() and texts[2].startswith("-"), texts
    guide.finish()
    assert states[1].grammar.validate([one, two, dash]) == 3  # back at the start
    guide = DraftGuide([state("late", StructuredOutputsParams(regex="a"))], VOCAB)
    assert guide.grammars == {}  # no matcher yet (first sample not reached): unguided
