"""What both processes run on torch: prompt encoding (`prompts`), the weight-sync process group
(`process_group`), the allowed SDPA kernels (`sdpa`), the CUDA-IPC weight handoff (`cuda_ipc`) and GPU
identities (`gpu_ids`); never imported by `shared_schemas/__init__`."""

__all__ = ["cuda_ipc", "gpu_ids", "process_group", "prompts", "sdpa"]
