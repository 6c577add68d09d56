# The regression-gate example (docs/regression-gates.md), the precision-analysis example
# (docs/results.md, Energy and cost) and the what-if planning example run on their own, by their
# paths: not in the main job.
collect_ignore = ["gate", "precision", "plan"]
