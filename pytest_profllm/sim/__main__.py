"""`python -m pytest_profllm.sim MODEL [vllm serve arguments]`: run the simulated engine."""

import sys

from pytest_profllm.sim.cli import main

sys.exit(main())
