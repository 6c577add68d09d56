"""`python -m pytest_profllm.options [PAGE]`: rewrite the options table of docs/options.md (or
PAGE) from the declarations, run from the repository's root."""

from __future__ import annotations

import sys
from pathlib import Path

from pytest_profllm.options.docs_table import PAGE, write

page = Path(sys.argv[1]) if len(sys.argv) > 1 else PAGE
print(f"{page}: {'rewritten' if write(page) else 'already up to date'}")
