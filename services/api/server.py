"""One API process: tokenizer, engine-core link and the OpenAI routes on a TCP port.

Several API processes serve one port: under `folio serve` they share the listening
socket the supervisor bound (``--listen-fd``); started alone they bind host:port
themselves (with SO_REUSEPORT when more than one is configured). Each also serves the
same routes on its own unix socket so its health can be probed alone.

On SIGTERM the process drains: new generation requests get 503, those in flight finish
(up to ``services.drain_timeout_s``), then it exits 0. If the engine core goes away,
open streams end with an error event, new requests get 503, and the process exits 1.
With ``parallel.data_parallel_size`` > 1 it links to every replica's engine core
(engine_replicas.py) and exits only when all of them are gone.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import socket
import sys

from config.schema import FolioConfig
from model_files.paths import resolve_model_path, served_model_name
from observability.logging import get_logger
from observability.tracing import Tracing
from services.api.admin_routes import AdminRoutes
from services.api.app import APIServer
from services.api.auth import APIKeys
from services.api.engine_client import EngineClient
from services.api.engine_replicas import EngineReplicas
from services.api.http_server import serve_api
from services.endpoints import api_admin_endpoint, engine_core_endpoint
from services.entrypoint import (ENGINE_LOSS_GRACE_S, StopSignal, first_completed,
                                 log_ready, run_service, service_arguments)
from services.transport import Endpoint
from text.tokenizer import Tokenizer

log = get_logger(__name__)


async def serve(config: FolioConfig, args: argparse.Namespace, stop: StopSignal) -> int:
    services = config.services
    tokenizer = Tokenizer.from_model_path(config.model.tokenizer
                                          or resolve_model_path(config.model.path))
    engine = _engine(config, f"api-{args.index}-{os.getpid()}")
    facts = await engine.start(timeout=services.startup_timeout_s)
    tracing = Tracing(config.observability, "api")
    api_keys = APIKeys.from_sources(config.api.api_keys, os.environ)
    admin = AdminRoutes(None, config, tracing)
    server = APIServer(engine, tokenizer,
                       served_model_name(config.model.path, config.model.served_model_name),
                       facts.max_model_len, tracer=tracing.tracer,
                       enable_metrics=config.observability.enable_metrics,
                       api=config.api, api_keys=api_keys, lora=config.lora, admin=admin)
    admin.server = server
    app = server.app()
    admin.follow(engine)  # after app(): a pushed config reaches the authenticator too
    own_socket = api_admin_endpoint(services, args.index)
    endpoints = [own_socket] if own_socket is not None else []
    sockets = []
    if args.listen_fd is not None:
        sockets.append(socket.socket(fileno=args.listen_fd))
    else:
        endpoints.append(Endpoint(host=services.api_host, port=services.api_port))
    runner = await serve_api(app, config.api, endpoints, sockets,
                             shutdown_timeout=1.0, reuse_port=services.num_api_servers > 1)
    public = ("{}:{}".format(*sockets[0].getsockname()[:2]) if sockets
              else str(endpoints[-1]))
    log_ready("api", config, facts, public, index=args.index, num_api_keys=len(api_keys))
    stop.mark_serving()
    await first_completed(stop.wait(), engine.dead.wait())
    status = 0
    if stop.is_set():
        server.admission.begin_drain()
        if not await server.admission.wait_idle(services.drain_timeout_s):
            log.warning("drain timed out", num_in_flight=server.admission.num_in_flight)
    else:
        log.error("the engine core went away; exiting")
        await asyncio.sleep(ENGINE_LOSS_GRACE_S)
        status = 1
    await runner.cleanup()
    await engine.close()
    tracing.shutdown()
    return status


def _engine(config: FolioConfig, client_id: str) -> EngineClient | EngineReplicas:
    """One engine core's client, or one per data-parallel replica behind a router."""
    parallel, services = config.parallel, config.services
    if parallel.data_parallel_size == 1:
        return EngineClient(engine_core_endpoint(services), client_id)
    return EngineReplicas(
        [EngineClient(engine_core_endpoint(services, r), f"{client_id}-r{r}")
         for r in range(parallel.data_parallel_size)],
        parallel.routing, parallel.routing_max_imbalance, config.cache.hash_algorithm,
        config.cache.enable_prefix_caching, config.observability.metrics_prefix)


def main(argv: list[str] | None = None) -> int:
    parser = service_arguments("python -m services.api")
    parser.add_argument("--index", type=int, default=0, help="this API process's number")
    parser.add_argument("--listen-fd", type=int, default=None,
                        help="serve an already-listening TCP socket (from `folio serve`)")
    return run_service("api", serve, parser, argv)


if __name__ == "__main__":
    sys.exit(main())
