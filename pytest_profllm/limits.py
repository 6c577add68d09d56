"""The limits on what the tool believes from outside: files, records, traces, images, uploads
and query strings. Every read of outside input checks one of these, so that any input gives a
result or one clear line, never a hang, a traceback or unbounded memory. README's "Limits on
input" lists them; keep the two in step.

This module is the bottom layer: it imports nothing of the package, and every layer may use it.
"""

from __future__ import annotations

# JSON nesting: a record nests a handful of levels; 64 leaves room for user metadata while
# staying far below Python's recursion limit (json and pydantic recurse per level).
MAX_JSON_DEPTH = 64

# A capacity search (plan/suite.py `CapacitySearch`): its lowest rate, below which a probe's
# arrival gaps (1 / rate) run to hours and a tiny rate's arithmetic under- or overflows; and
# the requests one probe run may send (high x min_duration_s for a rate, 10 x high for a
# concurrency), which are all drawn before the probe starts.
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
