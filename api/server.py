"""Running the API under uvicorn, as `ftc serve` does (also `python -m api.server`)."""

from __future__ import annotations

import argparse
import os
import socket
from asyncio import BaseTransport
from pathlib import Path

import uvicorn

from service.logs import LOG_FORMATS, logging_config

try:  # uvicorn's fast HTTP parser when it is installed, else its pure-Python one
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as _HttpProtocol
except ImportError:
    from uvicorn.protocols.http.h11_impl import H11Protocol as _HttpProtocol


class NoDelayHttpProtocol(_HttpProtocol):
    """uvicorn's HTTP/1.1 protocol with Nagle's algorithm switched off on every connection.

    With several workers uvicorn binds the listening socket itself (protocol number 0), and asyncio
    then skips TCP_NODELAY on accepted connections. A response written as headers then body waits
    for the client's delayed ACK, about 40 ms a request; this puts the option back.
    """

    def connection_made(self, transport: BaseTransport) -> None:  # type: ignore[override]
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        super().connection_made(transport)


def reset_multiprocess_metrics() -> None:
    """Empty PROMETHEUS_MULTIPROC_DIR (creating it) before the workers start, as prometheus_client
    asks: files of an earlier run would otherwise add old counts to this one's."""
    folder = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        for stale in Path(folder).glob("*.db"):
            stale.unlink(missing_ok=True)


def serve(
    host: str = "127.0.0.1", port: int = 8000, workers: int = 1, log_level: str = "info", log_format: str = "text"
) -> None:
    """Serve `api.app:create_app` (settings from FTC_* variables) until interrupted; uvicorn's own
    lines (startup, access log) go through the service's logging setup in `log_format`."""
    reset_multiprocess_metrics()
    uvicorn.run(
        "api.app:create_app",
        factory=True,
        host=host,
        port=port,
        workers=workers,
        http=NoDelayHttpProtocol,
        log_level=log_level,
        log_config=logging_config(log_format, log_level),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description="Serve the ftc job API.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--log-format", choices=LOG_FORMATS, default=os.environ.get("FTC_LOG_FORMAT", "text"))
    args = parser.parse_args()
    serve(args.host, args.port, args.workers, args.log_level, args.log_format)


if __name__ == "__main__":
    main()
