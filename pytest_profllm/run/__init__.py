"""Running one case: its outcome and record, the serve case end to end, telemetry, profiling."""
