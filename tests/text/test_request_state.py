"""One request's samples from engine outputs: what a stop token id leaves in the text."""
import pytest

from engine_core.outputs import EngineCoreOutput, FinishReason
from engine_core.sampling_params import SamplingParams
from text.request_state import RequestState


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("chunks", [[1, 1, 1], [3]], ids=["one_by_one", "together"])
def test_a_stop_token_ids_text_is_output_only_when_asked(smollm_tokenizer, include, chunks):
    ids = smollm_tokenizer.encode(" Paris.\nNext", add_special_tokens=False)[:3]
    assert smollm_tokenizer.decode(ids) == " Paris.\n"
    newline = ids[-1]
    params = SamplingParams(stop_token_ids=[newline], include_stop_str_in_output=include)
    state = RequestState(smollm_tokenizer, "r", None, [1, 2], params, ["r"])
    start = 0
    for size in chunks:
        last = start + size == len(ids)
        state.update(EngineCoreOutput(
            "r", ids[start:start + size], finish_reason=FinishReason.STOP if last else None,
            stop_reason=newline if last else None))
        start += size
    [sample] = state.output.outputs
    assert sample.text == (" Paris.\n" if include else " Paris.")
    assert sample.token_ids == ids and sample.stop_reason == newline
