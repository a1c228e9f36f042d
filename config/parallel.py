"""The ``parallel`` section: tensor parallelism over torch.distributed (README,
"Tensor parallelism") and data-parallel engine replicas behind the API (README, "Data
parallelism")."""
from __future__ import annotations

import socket
from dataclasses import dataclass, replace

from config.fields import _check, _f

DISTRIBUTED_BACKENDS = ("auto", "gloo", "nccl")
ROUTING_POLICIES = ("prefix_aware", "round_robin", "least_loaded")


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """How many processes share one model, and how they find each other."""

    tensor_parallel_size: int = _f(1, "ranks (one process each) that split every layer of "
                                   "the model: attention heads, MLP columns, vocabulary "
                                   "and the KV cache; rank 0 talks to the engine core")
    distributed_backend: str = _f("auto", "torch.distributed backend: auto (nccl on CUDA, "
                                  "gloo on the CPU), gloo or nccl")
    master_addr: str = _f("127.0.0.1", "address of rank 0's rendezvous (env:// "
                          "MASTER_ADDR); another host's address for ranks elsewhere")
    master_port: int = _f(0, "rendezvous port (MASTER_PORT); 0: `folio serve` and the "
                          "offline LLM pick a free one (single host only; set it when "
                          "ranks run on other hosts)")
    data_parallel_size: int = _f(1, "engine replicas (an engine core and its worker each, "
                                 "each with its own KV pool) behind the API processes")
    routing: str = _f("prefix_aware", "how the API picks a replica for a request: "
                      "prefix_aware (the replica caching the longest prefix of its blocks, "
                      "load breaking ties), round_robin or least_loaded")
    routing_max_imbalance: int = _f(16, "prefix_aware: when the best-prefix replica has "
                                    "more than this many more of this API process's "
                                    "requests in flight than the least loaded one, the "
                                    "least loaded one gets the request")

    def __post_init__(self):
        _check(self.tensor_parallel_size >= 1, "parallel.tensor_parallel_size",
               f"must be at least 1, got {self.tensor_parallel_size}")
        _check(self.distributed_backend in DISTRIBUTED_BACKENDS,
               "parallel.distributed_backend",
               f"must be one of {DISTRIBUTED_BACKENDS}, got {self.distributed_backend!r}")
        _check(0 <= self.master_port <= 65535, "parallel.master_port",
               f"must be a port number (0: pick one), got {self.master_port}")
        _check(bool(self.master_addr), "parallel.master_addr", "must not be empty")
        _check(1 <= self.data_parallel_size <= 64, "parallel.data_parallel_size",
               f"must be in 1..64, got {self.data_parallel_size}")
        _check(self.routing in ROUTING_POLICIES, "parallel.routing",
               f"must be one of {ROUTING_POLICIES}, got {self.routing!r}")
        _check(self.routing_max_imbalance >= 0, "parallel.routing_max_imbalance",
               f"must be non-negative, got {self.routing_max_imbalance}")
        _check(self.data_parallel_size == 1 or self.tensor_parallel_size == 1,
               "parallel.data_parallel_size", "data parallelism with tensor_parallel_size "
               "> 1 is not supported yet: set one of them to 1")

    @property
    def is_enabled(self) -> bool:
        return self.tensor_parallel_size > 1

    def with_rendezvous_port(self) -> "ParallelConfig":
        """This section with a concrete ``master_port``: a port free now when it is 0
        (rank 0's store binds it moments later; one host only)."""
        if not self.is_enabled or self.master_port:
            return self
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((self.master_addr, 0))
            return replace(self, master_port=s.getsockname()[1])
