"""One start-up sequence for every process that runs the model.

The offline ``LLM`` and the worker service both load a model the same way: resolve
``model.path``, load the weights into a ``ModelRunner``, size and allocate the KV pool,
build the tokenizer and merge the model's end tokens with the tokenizer's. The engine
core is then built from the resulting :class:`ModelFacts`, in-process
(:func:`in_process_engine`) or, in the services, from the worker's ``WorkerReady``.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from config.schema import FolioConfig
from engine_core.engine import EngineCore
from engine_core.model_facts import ModelFacts
from model_files.paths import resolve_model_path
from text.tokenizer import Tokenizer
from worker.device import resolve_device
from worker.distributed.follower import check_tp_supported
from worker.distributed.tp_group import init_tp_group
from worker.draft_runner import check_draft_tokenizer
from worker.heap import bound_heap_growth, release_freed_memory
from worker.model_runner import ModelRunner
from worker.worker_control import WorkerControl


@dataclass(slots=True)
class LoadedModel:
    """A model ready to run: its runner (weights + KV cache), tokenizer, facts and
    control verbs (sleep, weight updates, collective_rpc)."""

    runner: ModelRunner
    tokenizer: Tokenizer | None  # None: not kept (bootstrap_model's keep_tokenizer)
    facts: ModelFacts
    control: WorkerControl


def bootstrap_model(config: FolioConfig, keep_tokenizer: bool = True) -> LoadedModel:
    """Load the model of ``config`` and allocate its KV pool (call on the thread that
    will run the model: torch keeps one OpenMP team per calling thread).

    With ``parallel.tensor_parallel_size`` > 1 this process is rank 0: it joins the
    group (the other ranks must be starting: worker/distributed/rank_processes.py or
    `folio serve`) and holds rank 0's slice; the facts are every rank's (the KV pool is
    the smallest any rank can hold).

    ``keep_tokenizer=False`` (the worker service, which tokenizes nothing): the tokenizer
    is dropped once the end tokens are known, and structured output loads it again on
    its first grammar, so ~15 MB stay off the resident size until then."""
    bound_heap_growth()  # large temporaries go back to the OS (worker/heap.py)
    tp = None
    if config.parallel.is_enabled:
        check_tp_supported(config)
        tp = init_tp_group(config.parallel, 0, resolve_device(config.worker.device))
    runner = ModelRunner(config.model, config.memory, config.worker, config.scheduler,
                         lora_config=config.lora, speculative_config=config.speculative,
                         tp=tp)
    if runner.lora is not None:
        runner.lora.check_declared()  # a bad adapter in the YAML fails start-up
    num_blocks = runner.initialize_kv_cache()
    load_tokenizer = functools.partial(Tokenizer.from_model_path, config.model.tokenizer
                                       or resolve_model_path(config.model.path))
    tokenizer = load_tokenizer()
    if config.speculative.method == "draft_model":
        check_draft_tokenizer(tokenizer, config.speculative.draft_model)
    eos_token_ids = list(dict.fromkeys((*runner.eos_token_ids, *tokenizer.eos_token_ids)))
    if not keep_tokenizer:
        tokenizer = None
    runner.structured_output.use_tokenizer(load_tokenizer if tokenizer is None else tokenizer,
                                           eos_token_ids)
    release_freed_memory()  # what sizing the pool and parsing the tokenizer left behind
    facts = ModelFacts(num_blocks=num_blocks, block_size=config.memory.block_size,
                       max_model_len=runner.max_model_len,
                       vocab_size=runner.arch.vocab_size, eos_token_ids=eos_token_ids,
                       dtype=str(runner.dtype).removeprefix("torch."),
                       device=str(runner.device))
    return LoadedModel(runner, tokenizer, facts, WorkerControl(runner, config.worker))


def in_process_engine(config: FolioConfig) -> tuple[LoadedModel, EngineCore]:
    """The model and an EngineCore that runs it directly (no sockets): the offline path."""
    loaded = bootstrap_model(config)
    engine = EngineCore.from_model_facts(config.scheduler, config.cache, loaded.facts,
                                         executor=loaded.runner, lora_config=config.lora,
                                         lora_executor=loaded.runner.lora,
                                         speculative_config=config.speculative)
    return loaded, engine
