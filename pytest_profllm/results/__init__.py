"""Results: the JSON record, the SQLite store and its landing table, and `profllm ingest`."""
