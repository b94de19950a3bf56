"""What both processes run on torch: prompt encoding (`prompts`), the weight-sync process group
(`process_group`), the allowed SDPA kernels (`sdpa`) and the CUDA-IPC weight handoff (`cuda_ipc`); never
imported by `shared_schemas/__init__`."""

__all__ = ["cuda_ipc", "process_group", "prompts", "sdpa"]
