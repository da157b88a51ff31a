"""A gRPC echo server on loopback, for the scenarios and benchmarks that keep gRPC busy beside spawns."""

from __future__ import annotations

from typing import Any


def start_echo_server(service: str) -> tuple[Any, int]:
    """A started gRPC server on 127.0.0.1 whose unary method `/{service}/Echo` returns each request, and its
    port. Imports grpc when called: the caller decides when grpc loads (after stallwatch, before uvloop)."""
    from concurrent import futures

    import grpc

    handler = grpc.method_handlers_generic_handler(
        service, {"Echo": grpc.unary_unary_rpc_method_handler(lambda request, context: request)}
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port
