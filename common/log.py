"""structlog for every process: JSON lines in production, readable lines on a terminal.

Each line carries `service` and `replica`; a shell binds `rid` and `step` where they apply
(`structlog.contextvars.bind_contextvars(rid=...)` or `log.bind(rid=...)`). Libraries that
log through the standard `logging` module come out in the same format.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import structlog
from structlog.typing import EventDict, Processor, WrappedLogger

FORMATS = ("json", "console")
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class _Identity:
    """Adds service and replica to every line, including lines from other threads, where
    context variables bound in the main thread are not visible."""

    def __init__(self, service: str, replica: str | int | None) -> None:
        self.service, self.replica = service, replica

    def __call__(self, logger: WrappedLogger, method: str, event: EventDict) -> EventDict:
        event.setdefault("service", self.service)
        if self.replica is not None:
            event.setdefault("replica", self.replica)
        return event


def configure_logging(service: str, replica: str | int | None = None,
                      level: str = "INFO") -> None:
    """Route structlog and stdlib logging to stderr; calling it again replaces the set-up."""
    level = os.environ.get("HEADRACE_LOG_LEVEL", level).upper()
    if level not in LEVELS:
        raise ValueError(f"log level must be one of {list(LEVELS)}, got {level!r}")
    shared = _shared_processors(_Identity(service, replica))
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(ignore_frame_names=[__name__]),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False)  # so a later configure_logging still applies
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    *_renderers(_log_format())]))
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(level)


def get_logger(name: str | None = None, **bind: Any) -> structlog.stdlib.BoundLogger:
    """A lazy logger: safe at import time, it takes the configuration of its first call.
    `name` defaults to the calling module's."""
    args = (name,) if name else ()
    return structlog.stdlib.get_logger(*args, **bind)


def _shared_processors(identity: _Identity) -> list[Processor]:
    return [
        structlog.contextvars.merge_contextvars,
        identity,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]


def _log_format() -> str:
    chosen = os.environ.get("HEADRACE_LOG_FORMAT")
    if chosen is None:
        return "console" if sys.stderr.isatty() else "json"
    if chosen not in FORMATS:
        raise ValueError(f"HEADRACE_LOG_FORMAT must be one of {list(FORMATS)}, got {chosen!r}")
    return chosen


def _renderers(log_format: str) -> list[Processor]:
    if log_format == "console":
        return [structlog.dev.ConsoleRenderer()]
    return [structlog.processors.format_exc_info, structlog.processors.JSONRenderer(default=str)]
