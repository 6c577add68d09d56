"""Beyond one host: the same suites on a Ray cluster (`--profllm-ray`).

`driver` runs in pytest and hands each server group to the cluster; `node` runs a group on the
node Ray picked; `wire` is what travels between them. Ray itself is imported only once a run
asks for it.
"""
