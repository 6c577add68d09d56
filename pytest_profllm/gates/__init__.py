"""Regression gates: each case against its baseline (the runs with the same fingerprint), with
noise-aware verdicts, the history's change points, pytest-benchmark's view and the reports."""
