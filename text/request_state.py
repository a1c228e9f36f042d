"""One request's samples as their tokens arrive: text, stop strings, logprobs, n > 1.

The engine core sends token deltas per sample (engine id ``req_id`` for n == 1, else
``f"{i}_{req_id}"``). :class:`RequestState` turns each into a :class:`SampleDelta` (the
text it releases, its ids and logprobs, and the sample's end) and keeps the whole
:class:`RequestOutput` up to date. The offline ``LLM`` (through ``OutputProcessor``)
and the API process (streaming or not) both use it, so there is one implementation of
incremental text, stop-string trimming, logprobs and ``n`` > 1 assembly.

Stop strings are a front-end concern (they need text): when one matches, the sample
finishes here with ``finish_reason`` "stop" while the engine still runs it, and the
delta says so (``abort_in_engine``) so that the caller aborts it there.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from engine_core.outputs import EngineCoreOutput, TokenLogprobs
from engine_core.sampling_params import SamplingParams
from text.detokenizer import DetokenizedDelta, IncrementalDetokenizer
from text.request_output import CompletionOutput, RequestOutput
from text.tokenizer import Tokenizer


@dataclass(slots=True)
class SampleDelta:
    """What one engine output added to one sample."""

    index: int  # which sample of the request
    text: str  # text released by these tokens (may be empty)
    token_ids: list[int]
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort" once the sample ended
    stop_reason: int | str | None = None  # the stop string or token id that ended it
    abort_in_engine: bool = False  # a stop string ended it; the engine still runs it


@dataclass(slots=True)
class _Sample:
    completion: CompletionOutput
    detokenizer: IncrementalDetokenizer


class RequestState:
    """Accumulates one request's samples; ``update`` applies one engine output."""

    def __init__(self, tokenizer: Tokenizer, req_id: str, prompt: str | None,
                 prompt_token_ids: list[int], params: SamplingParams,
                 child_ids: list[str]):
        self.output = RequestOutput(req_id, prompt, list(prompt_token_ids))
        self.want_logprobs = params.logprobs is not None
        self._include_stop = params.include_stop_str_in_output
        self._samples: dict[str, _Sample] = {}
        for index, child_id in enumerate(child_ids):
            detokenizer = IncrementalDetokenizer(
                tokenizer, prompt_token_ids, skip_special_tokens=params.skip_special_tokens,
                stop=params.stop, include_stop_str_in_output=params.include_stop_str_in_output,
                min_tokens=params.min_tokens)
            completion = CompletionOutput(
                index=index, text="", token_ids=[],
                cumulative_logprob=0.0 if self.want_logprobs else None,
                token_logprobs=[] if self.want_logprobs else None)
            self._samples[child_id] = _Sample(completion, detokenizer)
            self.output.outputs.append(completion)

    @property
    def req_id(self) -> str:
        return self.output.request_id

    @property
    def child_ids(self) -> list[str]:
        """The engine ids of this request's samples, in index order."""
        return list(self._samples)

    @property
    def live_child_ids(self) -> list[str]:
        """Engine ids of the samples that have not ended here."""
        return [c for c, s in self._samples.items() if not s.completion.finished]

    @property
    def finished(self) -> bool:
        return self.output.finished

    def update(self, out: EngineCoreOutput) -> SampleDelta | None:
        """Apply one engine output; None when its sample has already ended here (a stop
        string ended it and the engine's abort is still in flight)."""
        sample = self._samples[out.req_id]
        c = sample.completion
        if c.finished:
            return None
        if c.index == 0 and not c.token_ids:
            # sample 0 computed the prompt; later samples fork from it, so their
            # "cached" prefix is a sibling's, not the prefix cache's
            self.output.num_cached_tokens = out.num_cached_tokens
        if out.prompt_logprobs is not None and self.output.prompt_token_logprobs is None:
            self.output.prompt_token_logprobs = out.prompt_logprobs
        shown = out.new_token_ids
        if (isinstance(out.stop_reason, int) and out.finish_reason is not None
                and not self._include_stop and shown):
            shown = shown[:-1]  # a stop token id's text is not output (vLLM's rule)
        released, new_ids = _detokenize(sample.detokenizer, shown)
        if not released.is_stopped:  # the stop token itself stays among the ids
            new_ids += out.new_token_ids[len(shown):]
        c.token_ids.extend(new_ids)
        logprobs = list(out.new_logprobs or [])[:len(new_ids)] if self.want_logprobs else []
        if logprobs:
            c.token_logprobs.extend(logprobs)
            c.cumulative_logprob += sum(lp.logprob for lp in logprobs)
        text, abort = released.text, False
        if released.is_stopped:
            c.finish_reason, c.stop_reason = "stop", released.stop_str
            abort = out.finish_reason is None
        elif out.finish_reason is not None:
            text += sample.detokenizer.finish().text
            c.finish_reason, c.stop_reason = str(out.finish_reason), out.stop_reason
        c.text = sample.detokenizer.output_text
        if c.finished and all(s.completion.finished for s in self._samples.values()):
            self.output.finished = True
        return SampleDelta(c.index, text, new_ids, logprobs, c.finish_reason, c.stop_reason,
                           abort)

    def abort(self) -> RequestOutput:
        """End every live sample with "abort" (client gone, error); the partial output."""
        for sample in self._samples.values():
            if not sample.completion.finished:
                sample.completion.finish_reason = "abort"
        self.output.finished = True
        return self.output


def _detokenize(detokenizer: IncrementalDetokenizer, token_ids: list[int]
                ) -> tuple[DetokenizedDelta, list[int]]:
    """The text ``token_ids`` release and the ids kept. Several ids arrive at once when
    drafts were accepted (speculative decoding): they go in one by one, and a stop
    string one of them completes drops the ids after it, as if each came in its step."""
    if len(token_ids) <= 1:
        return detokenizer.update(token_ids), list(token_ids)
    text = []
    for i, token_id in enumerate(token_ids):
        delta = detokenizer.update([token_id])
        text.append(delta.text)
        if delta.is_stopped:
            return DetokenizedDelta("".join(text), True, delta.stop_str), token_ids[:i + 1]
    return DetokenizedDelta("".join(text)), list(token_ids)
