"""pytest-profllm: vLLM serving benchmarks as parametrized pytest tests."""

__version__ = "0.1.0"
