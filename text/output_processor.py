"""Many requests' outputs at once: the offline ``LLM``'s side of the output path.

Each request is a :class:`RequestState` (text/request_state.py), the same object the
API process drives for one HTTP request; this class only routes a step's engine
outputs to their requests and collects the ones that finished.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from engine_core.outputs import EngineCoreOutput
from engine_core.sampling_params import SamplingParams
from text.logprob import position_logprobs, prompt_logprobs
from text.request_output import RequestOutput
from text.request_state import RequestState
from text.tokenizer import Tokenizer


@dataclass(slots=True)
class ProcessedStep:
    """What one step's outputs did: requests that finished, engine ids to abort."""

    finished: list[RequestOutput] = field(default_factory=list)
    to_abort: list[str] = field(default_factory=list)


class OutputProcessor:
    """Accumulates each request's samples until they all finish."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._requests: dict[str, RequestState] = {}
        self._child_to_parent: dict[str, str] = {}

    def add_request(self, req_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, child_ids: list[str]) -> None:
        """Register a request; ``child_ids[i]`` is the engine id of sample i."""
        self._requests[req_id] = RequestState(self.tokenizer, req_id, prompt,
                                              prompt_token_ids, params, child_ids)
        for child_id in child_ids:
            self._child_to_parent[child_id] = req_id

    def process(self, outputs: list[EngineCoreOutput]) -> ProcessedStep:
        """Apply one step's deltas."""
        step = ProcessedStep()
        for out in outputs:
            req_id = self._child_to_parent.get(out.req_id)
            if req_id is None:
                continue  # its request already finished or was aborted
            state = self._requests[req_id]
            delta = state.update(out)
            if delta is not None and delta.abort_in_engine:
                step.to_abort.append(out.req_id)
            if state.finished:
                self._forget(state)
                step.finished.append(self._with_vllm_logprobs(state.output))
        return step

    def _with_vllm_logprobs(self, output: RequestOutput) -> RequestOutput:
        """``output`` with vLLM's logprob shapes filled from the engine's (offline only:
        the API renders the engine's directly, without decoding every top-k token)."""
        if output.prompt_token_logprobs is not None:
            output.prompt_logprobs = prompt_logprobs(output.prompt_token_logprobs,
                                                     self.tokenizer)
        for c in output.outputs:
            if c.token_logprobs is not None:
                c.logprobs = [position_logprobs(lp, self.tokenizer) for lp in c.token_logprobs]
        return output

    def abort(self, req_id: str) -> RequestOutput | None:
        """Forget a request (client went away); returns its partial output."""
        state = self._requests.get(req_id)
        if state is None:
            return None
        self._forget(state)
        return self._with_vllm_logprobs(state.abort())

    def _forget(self, state: RequestState) -> None:
        del self._requests[state.req_id]
        for child_id in state.child_ids:
            self._child_to_parent.pop(child_id, None)

    @property
    def num_unfinished(self) -> int:
        return len(self._requests)
