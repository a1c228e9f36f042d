"""The worker's OpenMP spin count, set before torch loads libgomp (which reads it once).

An OpenMP thread that finds no work spins before it sleeps; libgomp's default, 300,000
spins, is milliseconds. On a machine whose cores are shared (two cores, the API, the
engine core and any other busy process beside the worker) a thread waiting at a
parallel region's end for a partner that lost its core spins that long each time, and
a step has hundreds of regions: a short request's first token took 997 ms instead of
35 ms (p50) while one busy process ran (benchmarks/cpu_contention.py). With 3000 spins
it took 81 ms, with decode, serving and offline throughput within noise.
``worker.omp_spin_count`` sets it; a GOMP_SPINCOUNT or OMP_WAIT_POLICY already in the
environment is left alone.
"""
from __future__ import annotations

import argparse
import os
from collections.abc import MutableMapping, Sequence

from config.loader import load_config, parse_set_overrides
from config.schema import ConfigError

USER_SETTINGS = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")


def spin_count_env(spin_count: int | None, environ: MutableMapping[str, str]) -> bool:
    """Put ``spin_count`` into ``environ`` as GOMP_SPINCOUNT unless it is None or the
    environment already says how OpenMP threads wait; whether it did."""
    if spin_count is None or any(name in environ for name in USER_SETTINGS):
        return False
    environ["GOMP_SPINCOUNT"] = str(spin_count)
    return True


def apply_from_argv(argv: Sequence[str],
                    environ: MutableMapping[str, str] = os.environ) -> bool:
    """The worker's command line (``--config``, ``--set``) → ``spin_count_env``. A config
    that does not load changes nothing here: the service reports it as it starts."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--config", default=None)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args, _ = parser.parse_known_args(list(argv))
    try:
        config = load_config(args.config, parse_set_overrides(args.overrides))
    except (ConfigError, OSError, ValueError):
        return False
    return spin_count_env(config.worker.omp_spin_count, environ)
