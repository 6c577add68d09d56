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
