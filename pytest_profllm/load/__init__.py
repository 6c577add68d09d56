"""The load generator: prompts (`dataset`), the HTTP stream reader, the client and its
processes, vLLM's metric definitions, and one benchmark against a running server (`bench`)."""
