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
