"""The limits on what the tool believes from outside: files, records, traces, images, uploads
and query strings. Every read of outside input checks one of these, so that any input gives a
result or one clear line, never a hang, a traceback or unbounded memory. The manual's "Limits on
input" (docs/limits-and-faults.md) lists them; keep the two in step.

This module is the bottom layer: it imports nothing of the package, and every layer may use it.
"""

from __future__ import annotations

import gzip
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson

# JSON nesting: a record nests a handful of levels; 64 leaves room for user metadata while
# staying far below Python's recursion limit (json and pydantic recurse per level).
MAX_JSON_DEPTH = 64

# A capacity search (plan/suite/capacity.py `CapacitySearch`): its lowest rate, below which a
# probe's arrival gaps (1 / rate) run to hours and a tiny rate's arithmetic under- or
# overflows; and the requests one probe run may send (high x min_duration_s for a rate,
# 10 x high for a concurrency), which are all drawn before the probe starts.
MIN_SEARCH_RATE = 0.001
MAX_PROBE_REQUESTS = 1_000_000

# A prepared page's query string (bytes, as sent): uvicorn refuses request heads over 16 KiB
# anyway, and this keeps a search text, escaped, far below SQLite's 50,000-byte LIKE pattern.
MAX_QUERY_STRING_BYTES = 16_384

# An uploaded file (browse/upload.py): a record is tens of kilobytes, a bench result with
# every request's figures a few MB; the body is held in memory while it is checked.
MAX_UPLOAD_BYTES = 64 * 2**20

# Profiler traces a run page lists from its record: one per GPU worker is a handful; each is
# checked on disk, and a hostile record may name millions.
MAX_TRACE_FILES = 1_024

# A JSON document read whole (a ShareGPT or conversation file): ShareGPT's own is 0.64 GB,
# and Python holds a parsed document in several times its size.
MAX_JSON_BYTES = 1 << 30
# A record file: a record is 5-10 KB; 1,000 metrics and 1,000 engine arguments with long
# values stay far below this.
MAX_RECORD_BYTES = 64 << 20
# A live file (load/live_status.py): a process's running cases, read every 2 s by the
# "Running now" page and twice a second by the live view; one holds a few cases with a
# telemetry series and 600 running medians each (~100 KB). Files read from one live folder.
MAX_LIVE_FILE_BYTES = 16 << 20
MAX_LIVE_FILES = 1_024
# A column per metric and per engine argument: SQLite's tables hold 2,000 columns at most, and
# the registry's arguments and the record's fields take about 600 of them.
MAX_RESULTS = 1_000
MAX_SERVER_ARGUMENTS = 1_000
# One argument of a server's command line (and one VAR=value of its environment), in bytes:
# Linux refuses a longer one at exec (MAX_ARG_STRLEN, 32 pages of 4 KiB with its NUL), and
# the start then fails with `OSError: Argument list too long`. A suite is refused first.
MAX_ARGUMENT_BYTES = 32 * 4096 - 1
# One line of a JSON-lines file (a trace's request, a dataset's row, a request row).
MAX_JSON_LINE_BYTES = 16 << 20
# A per-request file (`RUN.requests.jsonl.gz`), decompressed: a probe of 1,000,000 requests with
# their inter-token gaps stays below it; a few MB of gzip can expand to terabytes.
MAX_REQUEST_FILE_BYTES = 1 << 30
# Rows of a per-request file: never more than its record's completed + failed, and never more
# than a probe may send; the file is read a row at a time, so a refused one costs no memory.
MAX_REQUEST_ROWS = MAX_PROBE_REQUESTS
# Tokens of one request (input and output): no model's context is longer (Llama 4 Scout's:
# 10 M). Where the server's max_model_len is known, that is the limit.
MAX_REQUEST_TOKENS = 10 << 20
# A trace replay, after time scaling: longer than a day is a unit mistaken (ms for s), and
# a case would wait that long.
MAX_REPLAY_S = 24 * 3600.0
# A GPU-hour price (--profllm-gpu-hour-price), USD: a rented H100 costs a few dollars an hour;
# a million is far above any GPU's and keeps every cost figure finite (a price near 1e308
# overflowed dollars per million tokens to inf, which JSON cannot hold).
MAX_GPU_HOUR_PRICE_USD = 1_000_000.0
# Re-measuring (--profllm-remeasure): more runs of one load than this only repeat a host that
# stays busy; and the session's re-measuring stops once it has taken as long as the session's
# first measurements (see load/remeasure_budget.py).
MAX_REMEASURE = 10
# What `profllm calibrate` replays of one run, many times over in its fit (each fold, each
# step): its requests, and their tokens in and out. vLLM's own serving benchmarks send a few
# thousand requests of a few thousand tokens; a row past these is left out and named (one of
# 200,000,000 prompts held 2.2 GB, one request of 100,000,000 tokens ran for minutes).
MAX_CALIBRATE_REQUESTS = 20_000
MAX_CALIBRATE_TOKENS = 20_000_000
# Pixels of one image: above an 8K frame (33 M); 64 M pixels decode to 192 MB of RGB.
MAX_IMAGE_PIXELS = 64_000_000
# A server's Prometheus `/metrics` (load/scrape.py), read before and after every load and every
# half second during it. vLLM 0.33's families for one engine are 46 KB (447 lines, as the
# simulated engine serves them), 1.9 MB for 64 data-parallel engines, parsed in 0.8 s on a busy
# 2-core host (benchmarks/perf/metrics_scrape.py): 8 MiB is four times that, and parses
# within the deadline. A body over it is not read further (a 200 MB one took `profllm bench`
# to 1.29 GB).
MAX_METRICS_BYTES = 8 << 20
# One line of it, in characters: vLLM's longest (vllm:cache_config_info's labels) is under
# 1 KB. The parser reads a line of many labels at about 6 us a character (a 340 KB line took
# 2.1 s), so a longer line is left out, naming its metric, and the deadline is checked often.
MAX_METRICS_LINE_CHARS = 16 << 10
# Distinct series, samples summed over their labels: vLLM 0.33 has about 450 (names and bucket
# bounds) however many engines it runs; 8 MiB of tiny distinct names would be a million.
MAX_METRICS_SERIES = 10_000
# The whole scrape (connecting, the answer, the body, its parsing), in seconds. requests'
# timeout of 2 s was per read, so a body that trickled a line every 0.5 s never ended (a case
# ran until SIGTERM). 5 s leaves a server whose event loop is busy with a load time to answer,
# and keeps a case's two scrapes around its load within 10 s whatever the server sends.
METRICS_DEADLINE_S = 5.0


class InputLimitError(ValueError):
    """Outside input over one of these limits; its text is the one line the user sees."""


def load_json(data: str | bytes, *, what: str, max_bytes: int = MAX_JSON_BYTES) -> Any:
    """`data` parsed as JSON (NaN and Infinity read as floats, for the caller to refuse by
    name); InputLimitError, naming `what`, where it is over `max_bytes` or nests deeper than
    MAX_JSON_DEPTH; ValueError (json's) where it is not JSON. Nothing here recurses per level:
    orjson refuses depth over 1024 itself, and Python's json reads only what a linear scan
    found shallow enough."""
    if len(data) > max_bytes:
        raise InputLimitError(
            f"{what} is {len(data):,} bytes, more than the {max_bytes:,} read"
        )
    try:
        value = orjson.loads(data)
    except orjson.JSONDecodeError as error:
        if str(error).startswith("depth limit exceeded"):
            raise _too_deep(what) from None
        # NaN, Infinity, a lone surrogate: Python's json reads them, once shallow enough.
        raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
        if _scan_depth(raw) > MAX_JSON_DEPTH:
            raise _too_deep(what) from None
        value = json.loads(data, parse_int=_int_as_orjson_reads)
    if _nested_deeper(value, MAX_JSON_DEPTH):
        raise _too_deep(what)
    return value


def _int_as_orjson_reads(digits: str) -> int | float:
    # orjson reads an integer beyond 64 bits as a float: the same file reads the same way
    # whether or not it also holds a NaN.
    number = int(digits)
    return number if -(2**63) <= number < 2**64 else float(number)


def _too_deep(what: str) -> InputLimitError:
    return InputLimitError(f"{what} nests JSON deeper than {MAX_JSON_DEPTH} levels")


# A JSON string (escapes included) or a bracket: brackets inside strings do not nest.
_TOKENS = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]', re.DOTALL)
_OPENING = frozenset(b"[{")


def _scan_depth(raw: bytes) -> int:
    """The deepest nesting of brackets outside strings, in one pass."""
    depth = deepest = 0
    for match in _TOKENS.finditer(raw):
        first = raw[match.start()]
        if first in _OPENING:
            depth += 1
            deepest = max(deepest, depth)
        elif first != ord('"'):
            depth -= 1
    return deepest


def _nested_deeper(value: Any, limit: int) -> bool:
    """Whether lists and mappings nest deeper than `limit`: a walk with its own stack, of
    classes compared, not isinstance (9 us on a record of 400 engine arguments, where a
    generator of isinstance took 190: ingest reads 100,000 of them)."""
    if value.__class__ is not dict and value.__class__ is not list:
        return False
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        for child in item.values() if item.__class__ is dict else item:
            if child.__class__ is dict or child.__class__ is list:
                stack.append((child, depth + 1))
    return False


def read_gzip_lines(path: Path) -> list[bytes]:
    """The lines of a gzipped JSON-lines file, read as they decompress (`iter_gzip_lines`)."""
    return list(iter_gzip_lines(path))


def iter_gzip_lines(path: Path) -> Iterator[bytes]:
    """The lines of a gzipped JSON-lines file, one at a time as they decompress, so that a
    reader holds only what it keeps of each: InputLimitError, naming the file (and line),
    where one line is over MAX_JSON_LINE_BYTES or the whole over MAX_REQUEST_FILE_BYTES, before
    more is read; gzip's own errors (OSError, EOFError) where it is not gzip."""
    total = 0
    number = 0
    with gzip.open(path, "rb") as handle:
        while line := handle.readline(MAX_JSON_LINE_BYTES + 1):
            number += 1
            if len(line) > MAX_JSON_LINE_BYTES:
                raise InputLimitError(
                    f"{path.name}:{number} is more than the {MAX_JSON_LINE_BYTES:,} "
                    "bytes a line may have, decompressed"
                )
            total += len(line)
            if total > MAX_REQUEST_FILE_BYTES:
                raise InputLimitError(
                    f"{path.name} decompresses to more than the {MAX_REQUEST_FILE_BYTES:,} "
                    "bytes read"
                )
            yield line


def check_pixels(width: int, height: int, *, what: str) -> None:
    """InputLimitError, naming `what`, for an image of more than MAX_IMAGE_PIXELS: read from
    its header, before any of it is decoded."""
    if width * height > MAX_IMAGE_PIXELS:
        raise InputLimitError(
            f"{what} is {width}x{height} pixels, more than the {MAX_IMAGE_PIXELS:,} an image "
            "may have"
        )


def too_many_pixels(what: str) -> InputLimitError:
    """The refusal of an image Pillow itself found too large to open (its header says more
    than twice Pillow's own limit, far beyond MAX_IMAGE_PIXELS)."""
    return InputLimitError(
        f"{what} has more than the {MAX_IMAGE_PIXELS:,} pixels an image may have"
    )

# The server's per-request trace spans (load/span_receiver.py, OTLP/HTTP protobuf exports on
# 127.0.0.1). One export: vLLM's batch span processor sends at most 512 spans a batch, each a
# few hundred bytes, so about 0.3 MB; 16 MB refuses only what is no export of ours (413).
MAX_SPAN_EXPORT_BYTES = 16 << 20
# Spans kept for one load: one per request it sent; a load never sends more than a probe may.
MAX_SPANS_PER_LOAD = MAX_PROBE_REQUESTS
# Loads awaiting their spans at once: one per case of the worker, and a few left over from
# attempts whose spans were never collected.
MAX_SPAN_LOADS = 64
