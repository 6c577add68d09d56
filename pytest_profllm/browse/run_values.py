"""How a run's stored values are read back and shown on its page: a column's JSON text, a
figure to four significant figures (browse/run_page.py, browse/run_capacity.py, and the
page's template through browse/run_views.py)."""

from __future__ import annotations

import json
import math
from typing import Any


def stored_json(value: Any, default: Any) -> Any:
    """A column's JSON text read back; `default` where it is not JSON text."""
    if not isinstance(value, str):
        return default
    try:
        return json.loads(value)
    except ValueError:
        return default


def shown(value: Any) -> str:
    """A figure as the page shows it (the template calls it too): four significant
    figures, a whole number from 10,000 up, `-` for none."""
    if isinstance(value, float):
        if math.isinf(value):
            return "inf"
        # Four significant figures, never in exponent form: from 10,000 up, whole numbers.
        return f"{value:.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
    if value is None:
        return "-"
    return str(value)
