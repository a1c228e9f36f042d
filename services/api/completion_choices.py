"""The choices of a /v1/completions answer, with the fields a request may ask for.

    echo                the prompt's text before the completion's (and, with logprobs,
                        its tokens: the first with a null logprob)
    max_tokens 0        (with echo) the prompt alone: the engine samples one token to
                        finish the prefill, and that token is not shown or counted
    logprobs k          per token: its logprob, the top k plus the token itself, and
                        ``text_offset`` (text/text_offset.py), k = 0 included
    prompt_logprobs k   vLLM's per-choice list: null, then {id: {logprob, rank,
                        decoded_token}} for each later prompt token
    return_token_ids    the prompt's and the completion's token ids
    return_tokens_as_token_ids   ``token_id:N`` in place of each token's text

A stream sends the echoed prompt as its own chunk before a choice's first tokens, and
keeps each choice's text offsets across chunks.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from engine_core.outputs import TokenLogprobs
from text.request_output import CompletionOutput, RequestOutput
from text.request_state import SampleDelta
from text.text_offset import TextOffsets


@dataclass(frozen=True, slots=True)
class ResponseOptions:
    """What a completion or chat request asked its answer to show (module docstring)."""

    echo: bool = False
    discard_output: bool = False
    num_logprobs: int | None = None
    num_prompt_logprobs: int | None = None
    return_token_ids: bool = False
    tokens_as_token_ids: bool = False


def token_text(tokenizer, token_id: int, as_id: bool) -> str:
    """A token as logprobs name it: its text, or ``token_id:N``."""
    return f"token_id:{token_id}" if as_id else tokenizer.decode(
        [token_id], skip_special_tokens=False)


def top_logprobs(lp: TokenLogprobs, k: int, name) -> dict[str, float]:
    """The k most likely tokens and the token itself (so k = 0 still shows it)."""
    top = {name(t): v for t, v in zip(lp.top_token_ids[:k], lp.top_logprobs[:k])}
    top.setdefault(name(lp.token_id), lp.logprob)
    return top


def prompt_logprobs_json(logprobs: list[TokenLogprobs] | None, k: int,
                         name) -> list[dict | None] | None:
    """vLLM's ``prompt_logprobs`` JSON: None, then each prompt token's and the top k's."""
    if logprobs is None:
        return None

    def entry(lp: TokenLogprobs) -> dict:
        out = {str(t): {"logprob": v, "rank": rank, "decoded_token": name(t)}
               for rank, (t, v) in enumerate(zip(lp.top_token_ids[:k], lp.top_logprobs[:k]),
                                             start=1)}
        out[str(lp.token_id)] = {"logprob": lp.logprob, "rank": lp.rank,
                                 "decoded_token": name(lp.token_id)}
        return out
    return [None] + [entry(lp) for lp in logprobs]


@dataclass(slots=True)
class CompletionChoices:
    """Renders one request's completion choices, whole or chunk by chunk."""

    tokenizer: object
    options: ResponseOptions
    prompt_texts: list[str | None]  # per prompt: its text, None for token ids
    skip_special_tokens: bool = True
    _offsets: dict[int, TextOffsets] = field(default_factory=dict)  # per streamed choice

    def _name(self, token_id: int) -> str:
        return token_text(self.tokenizer, token_id, self.options.tokens_as_token_ids)

    def _prompt_text(self, k: int, output: RequestOutput) -> str:
        text = self.prompt_texts[k] if k < len(self.prompt_texts) else None
        return text if text is not None else self.tokenizer.decode(
            output.prompt_token_ids, skip_special_tokens=False)

    def _logprobs(self, ids: list[int], entries: list[TokenLogprobs | None],
                  offsets: list[int]) -> dict:
        k, name = self.options.num_logprobs or 0, self._name
        return {"tokens": [name(t) for t in ids],
                "token_logprobs": [None if e is None else e.logprob for e in entries],
                "top_logprobs": [None if e is None else top_logprobs(e, k, name)
                                 for e in entries],
                "text_offset": offsets}

    def _prompt_part(self, output: RequestOutput) -> tuple[list[int], list, list[int]]:
        ids = output.prompt_token_ids
        scored = list(output.prompt_token_logprobs or [])
        entries = [None] + scored + [None] * (len(ids) - 1 - len(scored))
        offsets = TextOffsets(self.tokenizer, skip_special_tokens=False).advance(ids)
        return ids, entries[:len(ids)], offsets

    def _sample(self, c: CompletionOutput) -> tuple[str, list[int], list]:
        if self.options.discard_output:
            return "", [], []
        return c.text, c.token_ids, list(c.token_logprobs or [])

    def _extras(self, choice: dict, output: RequestOutput, token_ids: list[int],
                with_prompt: bool) -> dict:
        opts = self.options
        if opts.num_prompt_logprobs is not None and with_prompt:
            choice["prompt_logprobs"] = prompt_logprobs_json(
                output.prompt_token_logprobs, opts.num_prompt_logprobs, self._name)
        if opts.return_token_ids:
            if with_prompt:
                choice["prompt_token_ids"] = output.prompt_token_ids
            choice["token_ids"] = token_ids
        return choice

    def full(self, outputs: list[RequestOutput]) -> list[dict]:
        """Every choice of a finished request: sample i of prompt k is k * n + i."""
        opts, choices = self.options, []
        for k, output in enumerate(outputs):
            prefix = self._prompt_text(k, output) if opts.echo else ""
            for c in output.outputs:
                text, ids, lps = self._sample(c)
                logprobs = None
                if opts.num_logprobs is not None:
                    all_ids, entries, offsets = ([], [], []) if not opts.echo else \
                        self._prompt_part(output)
                    offsets = offsets + TextOffsets(
                        self.tokenizer, output.prompt_token_ids, start=len(prefix),
                        skip_special_tokens=self.skip_special_tokens).advance(ids)
                    logprobs = self._logprobs(all_ids + ids, entries + lps, offsets)
                choices.append(self._extras({
                    "index": k * len(output.outputs) + c.index, "text": prefix + text,
                    "logprobs": logprobs, "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason}, output, ids, True))
        return choices

    def chunk(self, delta: SampleDelta, k: int, output: RequestOutput) -> list[dict]:
        """The stream choices of one delta of prompt k's output (``delta.index`` is the
        choice's index): the echoed prompt first when the choice starts."""
        opts, choices = self.options, []
        offsets = self._offsets.get(delta.index)
        if offsets is None:  # this choice's first delta
            prefix = self._prompt_text(k, output) if opts.echo else ""
            offsets = self._offsets[delta.index] = TextOffsets(
                self.tokenizer, output.prompt_token_ids, start=len(prefix),
                skip_special_tokens=self.skip_special_tokens)
            if opts.echo:
                choice = {"index": delta.index, "text": prefix, "logprobs": None,
                          "finish_reason": None}
                if opts.num_logprobs is not None:
                    choice["logprobs"] = self._logprobs(*self._prompt_part(output))
                choices.append(self._extras(choice, output, [], True))
            elif opts.num_prompt_logprobs is not None or opts.return_token_ids:
                choices.append(self._extras({"index": delta.index, "text": "",
                                             "logprobs": None, "finish_reason": None},
                                            output, [], True))
        if opts.discard_output:
            text, ids, lps = "", [], []
        else:
            text, ids, lps = delta.text, delta.token_ids, delta.logprobs
        if text or ids or delta.finish_reason:
            logprobs = None
            if opts.num_logprobs is not None and ids:
                logprobs = self._logprobs(ids, list(lps), offsets.advance(ids))
            choice = {"index": delta.index, "text": text, "logprobs": logprobs,
                      "finish_reason": delta.finish_reason}
            if delta.finish_reason is not None:
                choice["stop_reason"] = delta.stop_reason
            choices.append(self._extras(choice, output, ids, False))
        return choices
