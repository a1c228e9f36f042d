"""Turn engine-core token deltas into text: detokenize, apply stop strings, gather samples.

Shared by the offline ``LLM`` and the API service. Stop strings are a front-end
concern (they need text): when one matches, the processor finishes the sample and
reports its id so the caller aborts it in the engine core.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from engine_core.outputs import EngineCoreOutput
from engine_core.sampling_params import SamplingParams
from services.api.detokenizer import IncrementalDetokenizer
from services.api.request_output import CompletionOutput, RequestOutput
from services.api.tokenizer import Tokenizer


@dataclass(slots=True)
class _SampleState:
    completion: CompletionOutput
    detokenizer: IncrementalDetokenizer
    want_logprobs: bool


@dataclass(slots=True)
class _RequestState:
    output: RequestOutput
    samples: dict[int, _SampleState] = field(default_factory=dict)


class OutputProcessor:
    """Accumulates each request's samples until they all finish."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._requests: dict[str, _RequestState] = {}
        self._child_to_parent: dict[str, tuple[str, int]] = {}

    def add_request(self, req_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, child_ids: list[str]) -> None:
        """Register a request; ``child_ids[i]`` is the engine id of sample i."""
        state = _RequestState(RequestOutput(req_id, prompt, list(prompt_token_ids)))
        for index, child_id in enumerate(child_ids):
            detok = IncrementalDetokenizer(
                self.tokenizer, prompt_token_ids, skip_special_tokens=params.skip_special_tokens,
                stop=params.stop, include_stop_str_in_output=params.include_stop_str_in_output)
            completion = CompletionOutput(index=index, text="", token_ids=[],
                                          cumulative_logprob=0.0 if params.logprobs is not None
                                          else None,
                                          logprobs=[] if params.logprobs is not None else None)
            state.samples[index] = _SampleState(completion, detok, params.logprobs is not None)
            state.output.outputs.append(completion)
            self._child_to_parent[child_id] = (req_id, index)
        self._requests[req_id] = state

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Apply one step's deltas. Returns requests that just finished and the engine
        ids to abort because a stop string ended them."""
        finished, to_abort = [], []
        for out in outputs:
            key = self._child_to_parent.get(out.req_id)
            if key is None:
                continue  # already finished by a stop string; the abort is in flight
            state = self._requests[key[0]]
            sample = state.samples[key[1]]
            if not sample.completion.token_ids:
                state.output.num_cached_tokens = max(state.output.num_cached_tokens,
                                                     out.num_cached_tokens)
            stopped_by_string = self._apply(sample, out)
            if stopped_by_string and out.finish_reason is None:
                to_abort.append(out.req_id)
            if sample.completion.finished:
                del self._child_to_parent[out.req_id]
                if all(s.completion.finished for s in state.samples.values()):
                    state.output.finished = True
                    finished.append(self._requests.pop(key[0]).output)
        return finished, to_abort

    def _apply(self, sample: _SampleState, out: EngineCoreOutput) -> bool:
        c = sample.completion
        c.token_ids.extend(out.new_token_ids)
        if sample.want_logprobs and out.new_logprobs:
            c.logprobs.extend(out.new_logprobs)
            c.cumulative_logprob += sum(lp.logprob for lp in out.new_logprobs)
        delta = sample.detokenizer.update(out.new_token_ids)
        if delta.is_stopped:
            c.text = sample.detokenizer.output_text
            c.finish_reason, c.stop_reason = "stop", delta.stop_str
            return True
        if out.finish_reason is not None:
            sample.detokenizer.finish()
            c.text = sample.detokenizer.output_text
            c.finish_reason = str(out.finish_reason)
            c.stop_reason = out.stop_reason
        else:
            c.text = sample.detokenizer.output_text
        return False

    def abort(self, req_id: str) -> RequestOutput | None:
        """Forget a request (client went away); returns its partial output."""
        state = self._requests.pop(req_id, None)
        if state is None:
            return None
        for child, (parent, _) in list(self._child_to_parent.items()):
            if parent == req_id:
                del self._child_to_parent[child]
        for s in state.samples.values():
            if s.completion.finish_reason is None:
                s.completion.finish_reason = "abort"
        state.output.finished = True
        return state.output

    @property
    def num_unfinished(self) -> int:
        return len(self._requests)
