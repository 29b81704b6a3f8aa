"""kvpush's warnings as a test reads them: at kvpush's own logger, which the connector stops propagating to the
root (``startup.share_vllm_logging``), so pytest's ``caplog`` sees none of them once a connector was built."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager


class _Said(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@contextmanager
def kvpush_warnings() -> Iterator[list[str]]:
    """The warnings kvpush's loggers say inside the block, in order."""
    logger = logging.getLogger("kvpush")
    handler, level = _Said(), logger.level
    logger.addHandler(handler)
    if logger.getEffectiveLevel() > logging.WARNING:
        logger.setLevel(logging.WARNING)
    try:
        yield handler.lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
