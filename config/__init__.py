"""Folio's configuration: schema (frozen dataclasses) and the YAML loader."""
from config.loader import load_config, parse_set_overrides
from config.schema import ConfigError, FolioConfig

__all__ = ["ConfigError", "FolioConfig", "load_config", "parse_set_overrides"]
