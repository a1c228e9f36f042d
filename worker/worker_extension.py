"""The worker extension: a class named in the YAML whose methods ``collective_rpc`` may call.

``worker.extension_cls: "package.module:Class"`` (vLLM's ``worker_extension_cls``) is
imported at start-up and constructed with the ModelRunner. Only the public methods the
class itself defines (its own and its bases', never ``object``'s, never a name with a
leading underscore) can be called by name; anything else is refused, so a method name
from a caller can never reach the runner's internals.
"""
from __future__ import annotations

import importlib
import inspect
from typing import Any

from config.fields import ConfigError


class RPCRefused(ValueError):
    """A collective_rpc call names no allowed method of the extension."""


def load_extension_class(spec: str) -> type:
    """The class ``spec`` ("package.module:Class") names; ConfigError if it cannot load."""
    module_name, _, class_name = spec.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"worker.extension_cls: cannot load {spec!r}: {e}") from None
    if not inspect.isclass(cls):
        raise ConfigError(f"worker.extension_cls: {spec!r} is not a class")
    return cls


def allowed_methods(cls: type) -> frozenset[str]:
    """Public functions defined on ``cls`` or its bases other than ``object``."""
    names = set()
    for klass in cls.__mro__:
        if klass is object:
            continue
        names.update(n for n, v in vars(klass).items()
                     if not n.startswith("_") and inspect.isfunction(v))
    return frozenset(names)


class WorkerExtension:
    """One instance of the declared extension class, and the calls it allows."""

    def __init__(self, spec: str, runner):
        self.cls = load_extension_class(spec)
        self.methods = allowed_methods(self.cls)
        self.instance = self.cls(runner)

    def call(self, method: str, args: tuple | list = (),
             kwargs: dict[str, Any] | None = None) -> Any:
        if not isinstance(method, str) or method not in self.methods:
            raise RPCRefused(f"{method!r} is not a method of the worker extension "
                             f"{self.cls.__name__} (allowed: {sorted(self.methods)})")
        return getattr(self.instance, method)(*args, **(kwargs or {}))
