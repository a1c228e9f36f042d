"""The offline engine: ``LLM(...).generate(prompts, params)`` in one process, no sockets."""
from __future__ import annotations

import itertools
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterable, Sequence

from config.loader import config_to_dict, load_config
from config.schema import ConfigError, FolioConfig
from engine_core.sampling_params import InvalidRequestError, SamplingParams
from folio.lora_request import LoRARequest
from folio.rl_hooks import RLHooks
from observability.logging import configure_logging, get_logger
from text.grammar_compiler import GrammarError
from text.output_processor import OutputProcessor
from text.request_output import RequestOutput
from text.tokenizer import Tokenizer
from worker.bootstrap import in_process_engine
from worker.distributed.follower import check_tp_supported
from worker.distributed.rank_processes import RankProcesses
from worker.distributed.tp_group import destroy_tp_group

log = get_logger(__name__)

PromptType = str | dict[str, Any] | list[int]
LoRARequests = LoRARequest | Sequence[LoRARequest | None] | None


class LLM(RLHooks):
    """vLLM-style offline engine over the same EngineCore and ModelRunner the services use.

    ``LLM()`` serves the default model from config/default.yaml; ``LLM("my.yaml")`` reads
    another file; keyword overrides take vLLM's flat names (``model=``, ``dtype=``,
    ``max_num_seqs=``, ``enable_prefix_caching=`` ...) or dotted keys
    (``**{"scheduler.policy": "priority"}``). Between ``generate`` calls the RL hooks
    (folio/rl_hooks.py) sleep and wake it, update its weights and reset its prefix cache.

    ``tensor_parallel_size=n`` splits the model over n processes: this one is rank 0
    and ranks 1..n-1 are spawned here (README, "Tensor parallelism"); ``shutdown()``, or
    leaving a ``with LLM(...)`` block, stops them.
    """

    def __init__(self, config: FolioConfig | str | Path | None = None, **overrides: Any):
        if isinstance(config, FolioConfig):
            if overrides:
                raise TypeError("pass overrides with a config path, not with a FolioConfig")
            self.config = config
        else:
            self.config = load_config(config, overrides)
        obs = self.config.observability
        configure_logging(obs.log_level, obs.log_format)
        log.debug("config resolved", config=config_to_dict(self.config))
        self._ranks = None  # tensor parallelism: ranks 1..n-1 run in child processes
        if self.config.parallel.data_parallel_size > 1:  # replicas live behind the API
            raise ConfigError("parallel.data_parallel_size: the offline LLM runs one engine; "
                              "replicas are a `folio serve` feature",
                              "parallel.data_parallel_size")
        if self.config.parallel.is_enabled:
            check_tp_supported(self.config)  # before any rank starts
            self.config = replace(self.config,
                                  parallel=self.config.parallel.with_rendezvous_port())
            self._ranks = RankProcesses(self.config)
        try:
            loaded, self.engine = in_process_engine(self.config)
        except BaseException:
            self.shutdown()
            raise
        self.runner, self.tokenizer = loaded.runner, loaded.tokenizer
        self.worker_control = loaded.control
        self.processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks and leave the group (nothing to do at
        size 1). The LLM cannot generate afterwards."""
        if self._ranks is None:
            return
        runner = getattr(self, "runner", None)
        if runner is not None:
            runner.stop_followers()
        destroy_tp_group()
        self._ranks.join()
        self._ranks = None

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if isinstance(prompt, dict) and "prompt" in prompt:
            return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
        raise InvalidRequestError(
            "a prompt is a string or {'prompt_token_ids': [...]}", "prompt")

    def generate(self, prompts: PromptType | Sequence[PromptType] | None = None,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 lora_request: LoRARequests = None,
                 prompt_token_ids: list[int] | list[list[int]] | None = None
                 ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order.

        ``prompt_token_ids`` (vLLM's keyword: one id list or a list of them) stands in
        for ``prompts``. All prompts are validated before any is queued (grammars
        compiled), so a bad one raises InvalidRequestError (naming the field) and leaves
        the engine untouched. ``lora_request``: one LoRA adapter for every prompt, or one
        (or None) per prompt (needs ``enable_lora``; folio/lora_request.py).
        """
        if prompt_token_ids is not None:
            if prompts is not None:
                raise ValueError("pass prompts or prompt_token_ids, not both")
            batch = (prompt_token_ids if prompt_token_ids and isinstance(
                prompt_token_ids[0], list) else [prompt_token_ids])
            prompts = [{"prompt_token_ids": ids} for ids in batch]
        if prompts is None:
            raise ValueError("generate() needs prompts or prompt_token_ids")
        if isinstance(prompts, (str, dict)) or (
                isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = ([sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams)
                  else list(sampling_params))
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        lora_ids = self._lora_ids(lora_request, len(prompts))
        tokenized = [self._tokenize(p) for p in prompts]
        for (_, ids), p, lora_id in zip(tokenized, params, lora_ids):
            self.engine.validate_request(ids, p, lora_id=lora_id)
            self._check_grammar(p)
        req_ids = []
        for (text, ids), p, lora_id in zip(tokenized, params, lora_ids):
            req_id = f"offline-{next(self._ids)}"
            child_ids = self.engine.add_request(req_id, ids, p, lora_id=lora_id)
            self.processor.add_request(req_id, text, ids, p, child_ids)
            req_ids.append(req_id)
        return self._run(req_ids, use_tqdm)

    def _lora_ids(self, lora_request: LoRARequests, num_prompts: int) -> list[int]:
        """Each prompt's adapter id, registering adapters met for the first time."""
        if lora_request is None or isinstance(lora_request, LoRARequest):
            lora_request = [lora_request] * num_prompts
        if len(lora_request) != num_prompts:
            raise ValueError(f"got {len(lora_request)} LoRA requests for {num_prompts} "
                             f"prompts")
        return [self._register_lora(r) if r is not None else 0 for r in lora_request]

    def _register_lora(self, request: LoRARequest) -> int:
        if self.engine.lora is None or self.runner.lora is None:
            raise InvalidRequestError("LoRA adapters are off: pass enable_lora=True",
                                      "lora_request")
        known = self.engine.lora.registry.by_name.get(request.lora_name)
        if known is not None and (known.lora_id, known.path) == (request.lora_int_id,
                                                                  request.lora_path):
            return known.lora_id
        try:
            self.runner.lora.read(request.lora_path)  # refused here, never mid-run
        except ValueError as e:
            raise InvalidRequestError(f"adapter {request.lora_name!r}: {e}",
                                      "lora_request") from None
        return self.engine.lora.register(request.lora_name, request.lora_path,
                                         request.lora_int_id).lora_id
    def _check_grammar(self, params: SamplingParams) -> None:
        """Compile a request's grammar before it is queued (kept in the runner's cache):
        InvalidRequestError naming ``structured_outputs`` if it does not compile."""
        if params.structured_outputs is None:
            return
        try:
            self.runner.structured_output.validate(params.structured_outputs.spec)
        except GrammarError as e:
            raise InvalidRequestError(str(e), "structured_outputs") from None

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             add_generation_prompt: bool = True, use_tqdm: bool = True,
             lora_request: LoRARequests = None,
             continue_final_message: bool = False) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them via the chat template.

        As over HTTP, special-token text inside message content stays plain text unless
        ``api.allow_special_tokens_in_content`` is on (text/chat_prompt.py).
        ``continue_final_message`` (with ``add_generation_prompt=False``, as in vLLM)
        leaves the final message open for the model to go on with."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        split = not self.config.api.allow_special_tokens_in_content
        prompts = [{"prompt_token_ids": self.tokenizer.encode_chat(self.tokenizer.render_chat(
            conv, add_generation_prompt, split_content=split,
            continue_final_message=continue_final_message))} for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm,
                             lora_request=lora_request)

    def _run(self, req_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm and len(req_ids) > 1:
            from tqdm import tqdm
            bar = tqdm(total=len(req_ids), desc="Processed prompts", dynamic_ncols=True)
        t0, num_out = time.perf_counter(), 0
        try:
            while len(done) < len(req_ids):
                outputs = self.engine.step()
                num_out += sum(len(o.new_token_ids) for o in outputs)
                step = self.processor.process(outputs)
                if step.to_abort:
                    self.engine.abort_request(step.to_abort)
                for out in step.finished:
                    done[out.request_id] = out
                if bar is not None and step.finished:
                    bar.update(len(step.finished))
                    bar.set_postfix(out_tok_s=f"{num_out / (time.perf_counter() - t0):.1f}")
                if not outputs and not self.engine.has_unfinished_requests() and \
                        len(done) < len(req_ids):
                    raise RuntimeError("engine went idle with requests unfinished")
        except BaseException:
            pending = [r for r in req_ids if r not in done]
            self.engine.abort_request(pending)
            for r in pending:
                self.processor.abort(r)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [done[r] for r in req_ids]
