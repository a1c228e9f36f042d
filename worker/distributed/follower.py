"""What every tensor-parallel rank but 0 runs: its slice of the model, step by step.

Such a rank keeps no request state. It loads its shard, sizes its KV pool with the
others (the smallest pool wins), then repeats rank 0's forward passes from the
broadcast step tensors and answers logits requests with its vocabulary slice, until
rank 0 says STOP (worker/distributed/step_channel.py). If rank 0 goes away the next
collective fails, and the rank exits with an error.
"""
from __future__ import annotations

import torch

from config.schema import FolioConfig
from observability.logging import get_logger
from worker.distributed.step_channel import LOGITS, STEP, STOP, StepChannel
from worker.distributed.tp_group import TPGroup
from worker.input_batch import batch_tensors
from worker.kv_cache import copy_blocks
from worker.model_runner import ModelRunner

log = get_logger(__name__)


def check_tp_supported(config: FolioConfig) -> None:
    """Refuse, at start-up, what tensor parallelism does not do yet (README)."""
    if not config.parallel.is_enabled:
        return
    if config.lora.enable_lora:
        raise ValueError("lora.enable_lora with parallel.tensor_parallel_size > 1: LoRA "
                         "adapters are not sharded yet; serve adapters at size 1")
    if config.speculative.method == "draft_model":
        raise ValueError("speculative.method=draft_model with parallel.tensor_parallel_size "
                         "> 1 is not supported yet; ngram speculation works")
    worker = config.worker
    for key, on in (("worker.enable_sleep_mode", worker.enable_sleep_mode),
                    ("worker.enable_weight_updates", worker.enable_weight_updates),
                    ("worker.extension_cls", bool(worker.extension_cls))):
        if on:  # the RL hooks act on rank 0's runner only
            raise ValueError(f"{key} with parallel.tensor_parallel_size > 1 is not "
                             f"supported yet: the RL hooks run at size 1")


def load_rank(config: FolioConfig, tp: TPGroup) -> ModelRunner:
    """This rank's runner with its KV pool (collective: every rank calls it together)."""
    check_tp_supported(config)
    runner = ModelRunner(config.model, config.memory, config.worker, config.scheduler,
                         lora_config=None, speculative_config=None, tp=tp)
    runner.initialize_kv_cache()
    return runner


@torch.inference_mode()
def follow(runner: ModelRunner) -> int:
    """Run rank 0's steps until STOP; returns how many forward passes ran."""
    channel = StepChannel(runner.tp, runner.arch.hidden_size, runner.dtype)
    num_steps = 0
    while True:
        message = channel.receive()
        if message.command == STOP:
            return num_steps
        if message.command == LOGITS:
            runner.model.compute_logits(message.hidden)
        elif message.command == STEP:
            copy_blocks(runner.kv_caches, *message.copies)
            if message.arrays is not None:
                input_ids, positions, attn, _ = batch_tensors(
                    message.arrays, [], runner.block_size, runner.arch.sliding_window,
                    runner.attention_backend)
                runner.model(input_ids, positions, runner.kv_caches, attn)
                num_steps += 1
        else:
            raise RuntimeError(f"unknown tensor-parallel command {message.command}")
