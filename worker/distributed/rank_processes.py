"""Starting the ranks other than 0 on this host, for the offline ``LLM``.

``folio serve`` starts them as supervised services instead (services/launcher.py); both
run :func:`run_rank`.
"""
from __future__ import annotations

import multiprocessing

from config.schema import FolioConfig
from observability.logging import configure_logging, get_logger
from worker.device import resolve_device

log = get_logger(__name__)
JOIN_TIMEOUT_S = 30.0


def run_rank(config: FolioConfig, rank: int) -> int:
    """Join the group as ``rank`` (> 0), load its shard, follow rank 0 until STOP.
    Returns the exit status; a lost peer raises (the caller reports it)."""
    from worker.distributed.follower import follow, load_rank
    from worker.distributed.tp_group import destroy_tp_group, init_tp_group
    tp = init_tp_group(config.parallel, rank, resolve_device(config.worker.device))
    try:
        runner = load_rank(config, tp)
        log.info("tensor-parallel rank ready", rank=rank, size=tp.size,
                 num_kv_heads=runner.model.shard.num_kv_heads, device=str(tp.device))
        num_steps = follow(runner)
        log.info("tensor-parallel rank stopped", rank=rank, num_steps=num_steps)
        return 0
    finally:
        destroy_tp_group()


def _rank_entry(config: FolioConfig, rank: int) -> None:
    obs = config.observability
    configure_logging(obs.log_level, obs.log_format)
    raise SystemExit(run_rank(config, rank))


class RankProcesses:
    """Ranks 1..n-1 of ``config`` as child processes of this one (rank 0)."""

    def __init__(self, config: FolioConfig):
        ctx = multiprocessing.get_context("spawn")  # never fork a process holding torch
        self.processes = [ctx.Process(target=_rank_entry, args=(config, rank), daemon=True,
                                      name=f"folio-tp-rank-{rank}")
                          for rank in range(1, config.parallel.tensor_parallel_size)]
        for p in self.processes:
            p.start()

    def failed(self) -> list[str]:
        """Ranks that exited with an error so far."""
        return [f"{p.name} (exit status {p.exitcode})" for p in self.processes
                if p.exitcode not in (None, 0)]

    def join(self, timeout: float = JOIN_TIMEOUT_S) -> None:
        """Wait for the ranks to leave (after rank 0 sent STOP); kill any that linger."""
        for p in self.processes:
            p.join(timeout)
            if p.is_alive():
                log.warning("tensor-parallel rank did not stop; killing it", rank=p.name)
                p.kill()
                p.join()
