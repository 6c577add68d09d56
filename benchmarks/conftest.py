# The regression-gate example (README, Regression gates), the precision-analysis example
# (README, Energy and cost) and the what-if planning example run on their own, by their
# paths: not in the main job.
collect_ignore = ["gate", "precision", "plan"]
