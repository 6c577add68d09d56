# The regression-gate example (docs/regression-gates.md), the precision-analysis example
# (docs/results.md, Energy and cost), the what-if planning example and the stop-when-sure example
# (docs/writing-suites/stop-when-sure.md, run by tests/test_until.py) run on their own, by their
# paths: not in the main job.
collect_ignore = ["gate", "precision", "plan", "until"]
