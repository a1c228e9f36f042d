"""Probe one service's /health from the command line (container health checks).

    python -m services.healthcheck worker|engine-core|api [--index I] --config FILE

Exit status 0 when the service answers 200, 1 otherwise; the answer is printed.
"""
from __future__ import annotations

import asyncio
import json
import sys

from config.loader import load_config, parse_set_overrides
from config.schema import ConfigError
from services.endpoints import api_admin_endpoint, engine_core_endpoint, worker_endpoint
from services.entrypoint import service_arguments
from services.transport import probe_health


def main(argv: list[str] | None = None) -> int:
    parser = service_arguments("python -m services.healthcheck")
    parser.add_argument("service", choices=("worker", "engine-core", "api"))
    parser.add_argument("--index", type=int, default=0, help="which API process")
    parser.add_argument("--timeout", type=float, default=5.0)
    args = parser.parse_args(argv)
    try:
        services = load_config(args.config, parse_set_overrides(args.overrides)).services
        endpoint = {"worker": lambda: worker_endpoint(services, args.replica),
                    "engine-core": lambda: engine_core_endpoint(services, args.replica),
                    "api": lambda: api_admin_endpoint(services, args.index)}[args.service]()
    except ConfigError as e:
        print(f"healthcheck: config error: {e}", file=sys.stderr)
        return 2
    if endpoint is None:
        print("healthcheck: services.socket_dir is not set", file=sys.stderr)
        return 2
    status, body = asyncio.run(probe_health(endpoint, args.timeout))
    print(json.dumps({"service": args.service, "endpoint": str(endpoint), "status": status,
                      "body": body}))
    return 0 if status == 200 else 1


if __name__ == "__main__":
    sys.exit(main())
