"""structlog set-up shared by every service: JSON lines to stderr, level by flag or env."""

from __future__ import annotations

import logging
import os
import sys

import structlog


def configure(service: str, level: str | None = None, json: bool | None = None, **context: object) -> structlog.BoundLogger:
    level_name = (level or os.environ.get("LOCKSTEP_LOG_LEVEL") or "info").upper()
    as_json = json if json is not None else os.environ.get("LOCKSTEP_LOG_FORMAT", "json") == "json"
    lvl = getattr(logging, level_name, logging.INFO)
    renderer = structlog.processors.JSONRenderer() if as_json else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    # Quiet libraries that log per request at INFO.
    logging.basicConfig(level=max(lvl, logging.WARNING), stream=sys.stderr)
    return structlog.get_logger().bind(service=service, **context)
