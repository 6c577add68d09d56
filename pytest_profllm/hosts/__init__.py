"""What this host offers: GPUs through NVML, device sets, the host-wide lease pool, processes
and atomic files."""
