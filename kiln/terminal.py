"""Text from files and clients, made safe to print: no control characters reach a terminal
or a log line (a model name holding "\\x1b[2J" or a newline could clear a screen or forge a
log entry), each is written as its Python escape instead."""

from __future__ import annotations

import logging
import re

# C0 and C1 controls, DEL, Unicode's line and paragraph separators and the bidirectional
# overrides (which can make a line read differently from what it holds).
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def printable(text: str) -> str:
    """`text` with every control character written as its escape (`\\n`, `\\x1b`...)."""
    return _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


class LogFormatter(logging.Formatter):
    """A formatter whose messages stay on one line, whatever their arguments hold; a
    traceback after the message is printed as usual."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = printable(record.message)
        return super().formatMessage(record)


def configure_logging(level: str) -> None:
    """kiln's log lines on stderr, `level` and up, with control characters escaped."""
    handler = logging.StreamHandler()
    handler.setFormatter(LogFormatter("%(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler])
