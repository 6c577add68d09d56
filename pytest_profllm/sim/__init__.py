"""The simulated engine: a server process that speaks vLLM's OpenAI-compatible API.

It stands in for vLLM where no GPU is present (CI, laptops), takes the same `vllm serve` argv,
and models latency with a step-based cost model. Records say when it produced them.
"""
