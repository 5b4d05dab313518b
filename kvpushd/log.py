"""structlog set-up: JSON lines when not on a terminal (journald), readable console otherwise."""

from __future__ import annotations

import logging
import sys

import structlog


def setup(level: str = "info", fmt: str = "auto") -> None:
    lvl = getattr(logging, level.upper(), logging.INFO)
    use_json = fmt == "json" or (fmt == "auto" and not sys.stderr.isatty())
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if use_json else structlog.dev.ConsoleRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        # the daemon configures once, at start: each module's logger is built on its first use, not
        # at every call (a per-WRITE debug line that is filtered out built a logger each time)
        cache_logger_on_first_use=True,
    )
    # NIXL and grpc log through the standard library.
    logging.basicConfig(level=max(lvl, logging.WARNING), stream=sys.stderr)
