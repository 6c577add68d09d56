# The regression-gate example runs on its own (README, Regression gates): not in the main job.
collect_ignore = ["gate"]
