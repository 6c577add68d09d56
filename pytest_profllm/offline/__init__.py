"""Offline benchmarks (`vllm bench throughput`, `vllm bench latency`): cases that run an engine
on their leased devices without a server, and read the JSON the benchmark writes."""
