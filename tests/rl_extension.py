"""A worker extension for the RL-hook tests (``worker.extension_cls``)."""
from __future__ import annotations


class ChecksumExtension:
    """Reads the running weights back, as a trainer checks that an update landed."""

    def __init__(self, runner):
        self.runner = runner

    def weight_checksum(self, name: str) -> float:
        """Sum of one model parameter (its Folio name, e.g. ``layers.0.mlp.down_proj.weight``)."""
        return float(dict(self.runner.model.named_parameters())[name].double().sum())

    def head_checksum(self) -> float:
        """Sum of the weight the LM head reads (a tied head's own copy when it has one)."""
        model = self.runner.model
        head = model.head_weight if model.head_weight is not None else model.embed_tokens.weight
        return float(head.double().sum())

    def _private(self) -> None:  # never callable through collective_rpc
        raise AssertionError("reached a private method")

    def memory_bytes(self) -> dict[str, int]:
        """Bytes the KV pool and the weights (a tied head's own copy included) hold now."""
        model = self.runner.model
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        if model.head_weight is not None:
            weights += model.head_weight.numel() * model.head_weight.element_size()
        kv = sum(c.numel() * c.element_size() for c in self.runner.kv_caches)
        return {"kv_cache": kv, "weights": weights}
