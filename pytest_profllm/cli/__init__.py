"""The `profllm` command: thin wrappers over the library, one clean error line at the edge."""
