"""`python -m pytest_profllm.cli`: the `profllm` command."""

import sys

from pytest_profllm.cli.main import main

sys.exit(main())
