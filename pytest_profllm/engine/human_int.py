"""vLLM's human-readable integers (`25.6k`, `1K`, `2M`), as its argument parser reads them.
A module of its own: the simulator's parser reads them too, and loads without the registry's
pydantic models.
"""

from __future__ import annotations

import re

_HUMAN_INT = re.compile(r"(\d+(?:\.\d+)?)([kKmMgGtT])")
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def human_int(text: str, allow_auto: bool = False) -> int | None:
    """vLLM's reading of `25.6k` (decimal), `1K` (binary) and plain digits; None if neither."""
    text = text.strip()
    if allow_auto and text.lower() in ("auto", "-1"):
        return -1
    if text.isdigit():
        return int(text)
    match = _HUMAN_INT.fullmatch(text)
    if match is None:
        return None
    number, suffix = match.groups()
    scale = _DECIMAL.get(suffix) or _BINARY[suffix]
    return int(float(number) * scale)
