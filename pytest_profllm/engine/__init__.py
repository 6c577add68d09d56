"""The vLLM boundary: which engine serves, the command that starts it, secrets, the
engine-argument registry, the vLLM install, and scripts that run inside vLLM's own Python
(`in_vllm/`)."""
