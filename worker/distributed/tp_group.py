"""The tensor-parallel group: one process per rank, joined through torch.distributed.

Rendezvous is env:// (MASTER_ADDR / MASTER_PORT / RANK / WORLD_SIZE, filled from the
``parallel`` section), so ranks on other hosts join by pointing ``master_addr`` at rank
0's host. The backend is gloo on the CPU and NCCL on CUDA (``auto``).

Every collective of the forward pass goes through :class:`TPGroup`, so a model built
without one (``tp=None``) runs exactly as before, with no torch.distributed at all.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from config.parallel import ParallelConfig

# Ranks other than 0 wait in a broadcast between steps, however long the server idles:
# the process-group timeout must outlast any idle spell. A dead peer is noticed through
# its closed connection (gloo) well before this.
GROUP_TIMEOUT = timedelta(days=30)


@dataclass(frozen=True, slots=True)
class TPGroup:
    """This process's place in the tensor-parallel group and its collectives."""

    rank: int
    size: int
    device: torch.device

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place (the row-parallel layers' partial products)."""
        dist.all_reduce(x)
        return x

    def min_int(self, value: int) -> int:
        """The smallest ``value`` over ranks (the KV pool every rank can hold)."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Rank 0: every rank's ``x`` side by side along the last dim; others: None."""
        x = x.contiguous()
        if self.is_first:
            parts = [torch.empty_like(x) for _ in range(self.size)]
            dist.gather(x, parts, dst=0)
            return torch.cat(parts, dim=-1)
        dist.gather(x, None, dst=0)
        return None

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``x`` into every rank's ``x`` (same shape and dtype everywhere)."""
        dist.broadcast(x, src=0)
        return x


def backend_for(config: ParallelConfig, device: torch.device) -> str:
    if config.distributed_backend != "auto":
        return config.distributed_backend
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(device: torch.device, rank: int) -> torch.device:
    """CUDA: one GPU per rank on each host (rank modulo the GPUs there); CPU: the CPU."""
    if device.type != "cuda":
        return device
    index = rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def init_tp_group(config: ParallelConfig, rank: int, device: torch.device) -> TPGroup:
    """Join the group as ``rank`` (blocks until all ``tensor_parallel_size`` ranks have)."""
    size = config.tensor_parallel_size
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is outside parallel.tensor_parallel_size={size}")
    if config.master_port == 0:
        raise ValueError("parallel.master_port is 0 here: `folio serve` and the offline LLM "
                         "pick a port for their ranks; a rank started on its own needs "
                         "the port rank 0 listens on")
    device = rank_device(device, rank)
    backend = backend_for(config, device)
    if backend == "nccl" and device.type != "cuda":
        raise ValueError("parallel.distributed_backend=nccl needs worker.device cuda")
    os.environ.update(MASTER_ADDR=config.master_addr, MASTER_PORT=str(config.master_port),
                      RANK=str(rank), WORLD_SIZE=str(size))
    kwargs = {"device_id": device} if backend == "nccl" else {}
    dist.init_process_group(backend, init_method="env://", rank=rank, world_size=size,
                            timeout=GROUP_TIMEOUT, **kwargs)
    return TPGroup(rank, size, device)


def destroy_tp_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
