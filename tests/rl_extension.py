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
