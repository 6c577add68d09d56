# The regression-gate example (README, Regression gates) and the precision-analysis example
# (README, Energy and cost) run on their own, by their paths: not in the main job.
collect_ignore = ["gate", "precision"]
