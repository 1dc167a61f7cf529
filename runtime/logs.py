"""One logging configuration for every phalanx process (launcher, keepers, workers, spares):
logfmt lines (``ts=... level=... logger=... event=x key=value``) or JSON lines, the worker's
rank and live generation on every record it logs, and steps redone after a rollback marked
``replay=true``. Messages are never cut: a long or multi-line message stays whole, on one
line (newlines escaped)."""
from __future__ import annotations

import ast
import contextlib
import json
import logging
import re
import sys
import threading
import time
from typing import Any, Iterator, TextIO

FORMATS = ("logfmt", "json")
DEFAULT_FORMAT = "logfmt"
# attributes every LogRecord has: anything else on a record came from ``extra=``
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {
    "message", "asctime", "taskName"}
_RESERVED = ("ts", "level", "logger", "msg", "exc", "stack")
_KEY = r"[A-Za-z_][\w.-]*"
_PAIR = re.compile(rf"({_KEY})=(\"(?:\\.|[^\"\\])*\"|'(?:\\.|[^'\\])*'|\S*)(?:\s+|$)")
_HEAD = re.compile(rf"^([\w.-]+)\s+(?={_KEY}=)")
_NUMBER = re.compile(r"-?\d+(\.\d+)?([eE][-+]?\d+)?")

_lock = threading.Lock()
_fields: dict[str, Any] = {}          # bound to every record (values may be callables)
_format = DEFAULT_FORMAT


class _Stderr(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a record comes (a worker redirects it)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, value: TextIO) -> None:
        pass


def configure_logging(fmt: str = DEFAULT_FORMAT, level: int = logging.INFO,
                      stream: TextIO | None = None) -> logging.Handler:
    """Make the root logger write ``fmt`` lines (``logfmt`` or ``json``) at ``level`` to
    ``stream`` (default: the process's stderr), in place of the handlers that wrote to the
    terminal (``basicConfig``'s, an earlier call's); others (a file, a test's capture)
    stay. The format is remembered (``current_format``): the launcher's actors are told
    to log the same way. Raises ValueError for an unknown format."""
    global _format
    if fmt not in FORMATS:
        raise ValueError(f"log format {fmt!r} is unknown: use one of {', '.join(FORMATS)}")
    handler = _Stderr() if stream is None else logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter() if fmt == "json" else LogfmtFormatter())
    handler.addFilter(BoundFields())
    root = logging.getLogger()
    terminal = {id(s) for s in (sys.stderr, sys.stdout, sys.__stderr__, sys.__stdout__)}
    for old in list(root.handlers):
        if any(isinstance(f, BoundFields) for f in old.filters) or (
                type(old) is logging.StreamHandler and id(old.stream) in terminal):
            root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    _format = fmt
    return handler


@contextlib.contextmanager
def logging_configured(fmt: str = DEFAULT_FORMAT, level: int = logging.INFO,
                       stream: TextIO | None = None) -> Iterator[logging.Handler]:
    """``configure_logging`` for the length of a block; the root logger's handlers, level
    and the remembered format are put back after it (a CLI run in-process, a test)."""
    global _format
    root = logging.getLogger()
    saved = list(root.handlers), root.level, _format
    try:
        yield configure_logging(fmt, level, stream)
    finally:
        for handler in list(root.handlers):
            root.removeHandler(handler)
        for handler in saved[0]:
            root.addHandler(handler)
        root.setLevel(saved[1])
        _format = saved[2]


def current_format() -> str:
    """The format this process was configured with (``logfmt`` until configured)."""
    return _format


def bind_fields(**fields: Any) -> None:
    """Add ``fields`` to every record logged in this process from now on (a value that is
    callable is called per record, so a live value such as the generation stays current);
    ``None`` removes a field. Thread-safe."""
    with _lock:
        for name, value in fields.items():
            if value is None:
                _fields.pop(name, None)
            else:
                _fields[name] = value


def bound_fields() -> dict[str, Any]:
    """The fields ``bind_fields`` set, callables evaluated."""
    with _lock:
        items = list(_fields.items())
    return {name: value() if callable(value) else value for name, value in items}


class BoundFields(logging.Filter):
    """Puts the bound fields (rank, generation, ...) on each record it passes, unless the
    record already carries one of that name (an ``extra=``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        for name, value in bound_fields().items():
            if not hasattr(record, name):
                setattr(record, name, value)
        return True


class ReplayMarker:
    """Tells a step redone after a rollback from a new one: ``mark(step)`` is True when
    ``step`` is at or below the highest step already marked."""

    def __init__(self, highest: int = -1) -> None:
        self.highest = highest

    def mark(self, step: int) -> bool:
        replay = step <= self.highest
        self.highest = max(self.highest, step)
        return replay


# -- formatting -----------------------------------------------------------------------------

def _timestamp(record: logging.LogRecord) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + \
        f".{int(record.msecs):03d}Z"


def _extras(record: logging.LogRecord) -> dict[str, Any]:
    return {name: value for name, value in vars(record).items()
            if name not in _STANDARD and not name.startswith("_")}


def _exception_text(formatter: logging.Formatter, record: logging.LogRecord) -> dict[str, str]:
    found = {}
    if record.exc_info:
        found["exc"] = formatter.formatException(record.exc_info)
    elif record.exc_text:
        found["exc"] = record.exc_text
    if record.stack_info:
        found["stack"] = formatter.formatStack(record.stack_info)
    return found


def quote(value: Any) -> str:
    """A logfmt value: bare when it has no space, quote, '=' or control character; else
    double-quoted with backslash escapes. Never shortened."""
    text = value if isinstance(value, str) else (
        "true" if value is True else "false" if value is False else str(value))
    if text and not any(c in text for c in ' "=\\') and text.isprintable():
        return text
    return json.dumps(text, ensure_ascii=False)


def _one_line(text: str) -> str:
    return text.replace("\n", "\\n").replace("\r", "\\r")


def split_message(message: str) -> tuple[dict[str, Any], bool]:
    """The ``key=value`` fields of a phalanx message (``event=x rank=1 error='...'``; a bare
    first word such as ``tier_commit tier=disk`` is the event), and whether the whole
    message was such fields (when not, the fields before the free text). Values are
    unquoted; integers, floats and true/false typed."""
    text = message.strip()
    found: dict[str, Any] = {}
    head = _HEAD.match(text)
    if head:
        found["event"] = head.group(1)
        text = text[head.end():]
    pos, last = 0, ""
    while pos < len(text):
        pair = _PAIR.match(text, pos)
        if pair is None:   # free text after ``last=``: its value may go on, so it is dropped
            found.pop(last, None)
            return found, False
        last = pair.group(1)
        found[last] = _typed(pair.group(2))
        pos = pair.end()
    return found, bool(found)


def _typed(raw: str) -> Any:
    if len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "'\"":
        try:
            text = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            return raw[1:-1]
        return _json(text) if raw[0] == '"' else text
    if raw[:1] in "[{":
        return _json(raw)
    if raw in ("true", "True"):
        return True
    if raw in ("false", "False"):
        return False
    if _NUMBER.fullmatch(raw):
        return float(raw) if any(c in raw for c in ".eE") else int(raw)
    return raw


def _json(text: str) -> Any:
    """A JSON list or mapping (``ranks=[1,2]``, ``phases_s="{...}"``) as its value, else the
    text itself."""
    if text[:1] in "[{":
        try:
            return json.loads(text)
        except ValueError:
            pass
    return text


class LogfmtFormatter(logging.Formatter):
    """``ts=<UTC ISO-8601> level=<level> logger=<name> <bound and extra fields> <message>``.

    A message made of ``key=value`` fields is written as it is (a bare first word becomes
    ``event=``); any other message becomes ``msg="..."``. A bound field the message already
    names is not repeated. Newlines are escaped, so one record is one line."""

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        parts = [f"ts={_timestamp(record)}", f"level={record.levelname.lower()}",
                 f"logger={quote(record.name)}"]
        fields, structured = split_message(message)
        parts += [f"{name}={quote(value)}" for name, value in _extras(record).items()
                  if name not in fields and name not in _RESERVED]
        if structured:
            body = message.strip()
            head = _HEAD.match(body)
            if head:
                body = f"event={head.group(1)} {body[head.end():]}"
            parts.append(_one_line(body))
        else:
            parts.append(f"msg={quote(message)}")
        parts += [f"{name}={quote(text)}" for name, text in _exception_text(self, record).items()]
        return " ".join(parts)


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ts, level, logger, the bound and extra fields, the
    message's own ``key=value`` fields (``split_message``), ``msg`` (the whole message,
    always) and ``exc`` (a traceback) when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        doc: dict[str, Any] = {"ts": _timestamp(record), "level": record.levelname.lower(),
                               "logger": record.name}
        for name, value in _extras(record).items():
            if name not in _RESERVED:
                doc[name] = value
        fields, _ = split_message(message)
        doc.update({k: v for k, v in fields.items() if k not in _RESERVED})
        doc["msg"] = message
        doc.update(_exception_text(self, record))
        return json.dumps(doc, ensure_ascii=False, default=str)
