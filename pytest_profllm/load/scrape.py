"""A server's Prometheus `/metrics`, read as outside input: what it says of itself, never what
loses a record, hangs a case or fills memory.

The body is read within limits.MAX_METRICS_BYTES and one deadline for the whole scrape
(limits.METRICS_DEADLINE_S: connecting, the answer, the body and its parsing), whatever the
server sends: a socket still open at the deadline is shut from a timer thread, so a body that
trickles ends there too. prometheus_client's parser reads it (`text_string_to_metric_families`),
a few lines at a time, so that the deadline is checked as it goes and a line it cannot read
costs only its own metric.

A metric whose samples are not finite, not positive or zero, or whose bucket bounds are not
bounds, is left out whole (all its samples, summed over the engines, would be wrong), and the
scrape says why (`Scraped.left_out`): the server's view (load/server_view.py) and the
telemetry (run/telemetry.py) put that in the record. A scrape that could not be read at all
is empty, and says why (`Scraped.unread`); `usable` tells the two apart.
"""

from __future__ import annotations

import contextlib
import http.client
import io
import math
import re
import socket
import threading
import time
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, TypeVar
from urllib.parse import urljoin, urlsplit

from pytest_profllm.limits import (
    MAX_METRICS_BYTES,
    MAX_METRICS_LINE_CHARS,
    MAX_METRICS_SERIES,
    METRICS_DEADLINE_S,
)

if TYPE_CHECKING:
    from prometheus_client.samples import Sample

# Lines are handed to the parser this many characters at a time: the deadline is checked
# between them (a batch of label-heavy lines takes about 0.2 s on a busy host).
_BATCH_CHARS = 32 << 10
_READ_CHUNK = 64 << 10
# A server behind a proxy may answer /metrics with a redirect (requests followed them).
_MAX_REDIRECTS = 3
_REDIRECTS = frozenset({301, 302, 303, 307, 308})
# A histogram's samples: one bad sample makes the whole histogram unusable.
_HISTOGRAM_SUFFIXES = ("_bucket", "_count", "_sum")
_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


# Labels whose every value keeps a key of its own, beside the sample's sum over all its
# labels: vLLM's speculative decoding counts accepted tokens per draft `position`.
KEPT_LABELS = frozenset({"position"})


def labelled_key(name: str, label: str, value: str) -> str:
    """The scrape's key of sample `name` with `label` = `value` (of KEPT_LABELS), summed over
    its other labels; Prometheus' own spelling, which no metric name can take."""
    return f'{name}{{{label}="{value}"}}'


class Scraped(dict[str, float]):
    """A scrape as {sample name: value summed over its labels}, each bucket of a histogram as
    {NAME_bucket@BOUND: its count summed over the engines} (load/server_view.py), each
    numeric label of an info metric (`*_info`) as {NAME.LABEL: its largest value over the
    engines}, and each value of a KEPT_LABELS label as {NAME{LABEL="VALUE"}: summed over the
    engines} (`labelled_key`). `left_out`: {metric: why its samples are not here}.
    `unread`: why nothing could be read (then it is empty)."""

    unread: str | None
    left_out: dict[str, str]

    def __init__(
        self,
        values: Mapping[str, float] | None = None,
        *,
        unread: str | None = None,
        left_out: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(values or {})
        self.unread = unread
        self.left_out = dict(left_out or {})


Scrape = TypeVar("Scrape", bound=Mapping[str, float])


def usable(scraped: Scrape | None) -> Scrape | None:
    """`scraped` where it is a reading of the server; None where there is none (no scrape, or
    one that could not be read)."""
    if scraped is None or getattr(scraped, "unread", None) is not None:
        return None
    return scraped


def unread_reason(scraped: Mapping[str, float] | None) -> str:
    """Why `scraped` is no reading of the server (`usable` gave None)."""
    return getattr(scraped, "unread", None) or "did not answer"


def left_out(scraped: Mapping[str, float] | None, name: str) -> str | None:
    """Why the scrape has no samples of metric `name` though the server sent some, or None."""
    reasons: dict[str, str] = getattr(scraped, "left_out", None) or {}
    return reasons.get(name)


def scrape_metrics(
    url: str,
    deadline_s: float = METRICS_DEADLINE_S,
    max_bytes: int = MAX_METRICS_BYTES,
) -> Scraped:
    """The Prometheus text endpoint at `url`, read and parsed within `deadline_s` seconds and
    `max_bytes` bytes (`Scraped`); never an exception. An engine without /metrics is no error:
    its scrape is unread."""
    deadline = time.monotonic() + deadline_s
    body = _read_body(url, deadline, max_bytes, deadline_s)
    if isinstance(body, _Unread):
        return Scraped(unread=body.reason)
    return parse_metrics(body, deadline=deadline, deadline_s=deadline_s)


class _Unread:
    def __init__(self, reason: str) -> None:
        self.reason = reason


def _late(deadline_s: float) -> _Unread:
    return _Unread(f"did not finish within {deadline_s:g} s")


def _read_body(url: str, deadline: float, max_bytes: int, deadline_s: float) -> str | _Unread:
    """The body of a GET of `url` as text, following a few redirects, by `deadline` (a
    monotonic time, `deadline_s` from the start); or why not."""
    for _ in range(_MAX_REDIRECTS + 1):
        got = _get(url, deadline, max_bytes, deadline_s)
        if not isinstance(got, tuple):
            return got
        url = urljoin(url, got[1])
    return _Unread(f"redirected more than {_MAX_REDIRECTS} times")


def _get(
    url: str, deadline: float, max_bytes: int, deadline_s: float
) -> str | _Unread | tuple[int, str]:
    """One GET: the body, why there is none, or (status, location) of a redirect."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = -1
    if parts.scheme not in ("http", "https") or not parts.hostname or port == -1:
        return _Unread(f"{url!r} is not an http(s) address")
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        return _late(deadline_s)
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    connection = kind(parts.hostname, port, timeout=remaining)
    cut = threading.Event()

    def cut_off() -> None:
        # Whatever the read waits on (a header, a chunk), shutting the socket ends it now.
        cut.set()
        sock = connection.sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    timer = threading.Timer(remaining, cut_off)
    timer.daemon = True
    timer.start()
    try:
        connection.connect()
        if cut.is_set():  # the timer fired while connecting: it found no socket to shut
            return _late(deadline_s)
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        # Asked for as it is: a compressed body would be a bound on the wrong bytes.
        connection.request("GET", path, headers={"Accept-Encoding": "identity"})
        response = connection.getresponse()
        if response.status in _REDIRECTS and response.getheader("Location"):
            return response.status, response.getheader("Location") or ""
        if response.status != 200:
            return _Unread(f"answered {response.status}")
        declared = response.getheader("Content-Length") or ""
        if declared.isdigit() and int(declared) > max_bytes:
            return _too_large(max_bytes)
        body = bytearray()
        while chunk := response.read1(min(_READ_CHUNK, max_bytes + 1 - len(body))):
            body += chunk
            if len(body) > max_bytes:
                return _too_large(max_bytes)
            if time.monotonic() > deadline:
                return _late(deadline_s)
        if cut.is_set():  # a shut socket reads as the end of the body
            return _late(deadline_s)
        return body.decode("utf-8", errors="replace")
    except (OSError, http.client.HTTPException, ValueError) as error:
        if cut.is_set():
            return _late(deadline_s)
        return _Unread(f"did not answer ({type(error).__name__}: {error})"[:300])
    finally:
        timer.cancel()
        connection.close()


def _too_large(max_bytes: int) -> _Unread:
    return _Unread(f"sent more than the {max_bytes:,} bytes read")


def parse_metrics(
    text: str, deadline: float = math.inf, deadline_s: float = METRICS_DEADLINE_S
) -> Scraped:
    """Prometheus text as a `Scraped`; unread where parsing it passes `deadline` (a monotonic
    time; `deadline_s` is how it is said) or it has more than MAX_METRICS_SERIES series."""
    reading = _Reading()
    try:
        for batch in _batches(text, reading):
            reading.add_batch(batch)
            if time.monotonic() > deadline:
                return Scraped(unread=f"did not finish within {deadline_s:g} s")
    except _TooManySeries:
        return Scraped(unread=f"has more than {MAX_METRICS_SERIES:,} series")
    return Scraped(reading.values, left_out=reading.left_out)


class _TooManySeries(Exception):
    pass


def _batches(text: str, reading: _Reading) -> Iterator[str]:
    """The body's lines a few at a time, with the last `# TYPE` line before them (the parser
    names a counter's samples by it); a line over MAX_METRICS_LINE_CHARS is left out."""
    batch: list[str] = []
    size = 0
    last_type = ""
    for line in io.StringIO(text):
        if len(line) > MAX_METRICS_LINE_CHARS:
            reading.leave_out(_name_of(line), f"a line of more than {MAX_METRICS_LINE_CHARS:,} "
                              "characters")
            continue
        stripped = line.strip()
        if not stripped or (stripped.startswith("#") and not stripped.startswith("# TYPE")):
            continue  # blank lines, HELP and other comments: nothing the figures read
        if stripped.startswith("# TYPE"):
            last_type = stripped + "\n"
        batch.append(stripped + "\n")
        size += len(stripped)
        if size >= _BATCH_CHARS:
            yield "".join(batch)
            batch, size = [last_type], len(last_type)
    if batch:
        yield "".join(batch)


def _name_of(line: str) -> str:
    """The metric a line names (what can be told of it without parsing it)."""
    match = _NAME.match(line.strip())
    return _family(match.group(0)) if match else "(a line without a metric name)"


def _family(name: str) -> str:
    for suffix in _HISTOGRAM_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


class _Reading:
    """What the samples read so far add up to, and the metrics left out."""

    def __init__(self) -> None:
        self.values: dict[str, float] = {}
        self.left_out: dict[str, str] = {}
        self._keys: dict[str, set[str]] = {}  # metric -> its keys in `values`

    def leave_out(self, family: str, why: str) -> None:
        self.left_out.setdefault(family, why)
        for key in self._keys.pop(family, ()):
            self.values.pop(key, None)

    def add_batch(self, batch: str) -> None:
        # Deferred: prometheus_client is needed only once a server's /metrics is read.
        from prometheus_client.parser import text_string_to_metric_families

        try:
            samples = [sample for family in text_string_to_metric_families(batch)
                       for sample in family.samples]
        except Exception:  # any: the parser raises what it meets (ValueError, IndexError, ...)
            # One line at a time, then: a line it cannot read costs its own metric only.
            for line in batch.split("\n"):
                if not line or line.startswith("#"):
                    continue
                try:
                    samples = [sample for family in text_string_to_metric_families(line)
                               for sample in family.samples]
                except Exception:  # any, as above
                    self.leave_out(_name_of(line), "a line that is not Prometheus text: "
                                   f"{line[:80]!r}")
                    continue
                self._add(samples)
            return
        self._add(samples)

    def _add(self, samples: list[Sample]) -> None:
        for sample in samples:
            name, labels, value = sample.name, sample.labels, float(sample.value)
            family = _family(name)
            if family in self.left_out:
                continue
            if "@" in name:  # a quoted name: it would read as one of the keys' bucket bounds
                self.leave_out(family, f"{name!r} has an '@', which no metric of vLLM's has")
                continue
            if not math.isfinite(value) or value < 0:
                self.leave_out(family, f"{name} is {value!r}, not a count or size")
                continue
            self._sum(family, name, value)
            if name.endswith("_bucket") and "le" in labels:
                try:
                    bound = float(labels["le"])
                except ValueError:
                    bound = math.nan
                if math.isnan(bound) or bound < 0:
                    self.leave_out(family, f"{name} has le={labels['le']!r}, not a bound")
                    continue
                # A bucket's count summed over every other label (the engines): its bound, as
                # a number, in the key ("0.5" and "0.50" are one bucket).
                self._sum(family, f"{name}@{bound!r}", value)
            if name.endswith("_info"):
                self._keep_numeric_labels(family, name, labels)
            for label in KEPT_LABELS.intersection(labels):
                # Summed over the engines, per value of the label (a draft position).
                self._sum(family, labelled_key(name, label, labels[label]), value)

    def _sum(self, family: str, key: str, value: float) -> None:
        if family in self.left_out:
            return
        total = self.values.get(key, 0.0) + value
        if not math.isfinite(total):
            self.leave_out(family, f"{key} sums past what a float holds")
            return
        if key not in self.values:
            if len(self.values) >= MAX_METRICS_SERIES:
                raise _TooManySeries
            self._keys.setdefault(family, set()).add(key)
        self.values[key] = total

    def _keep_numeric_labels(self, family: str, name: str, labels: dict[str, str]) -> None:
        for label, text in labels.items():
            try:
                number = float(text)
            except ValueError:  # "None", "True", "auto": not a figure
                continue
            if math.isfinite(number) and number >= 0:  # a count or a size, as every figure
                key = f"{name}.{label}"
                if key not in self.values and len(self.values) >= MAX_METRICS_SERIES:
                    raise _TooManySeries
                self._keys.setdefault(family, set()).add(key)
                self.values[key] = max(self.values.get(key, number), number)
