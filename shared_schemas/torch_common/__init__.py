"""What both processes run on torch: prompt encoding (`prompts`), the weight-sync process group
(`process_group`) and the allowed SDPA kernels (`sdpa`); never imported by `shared_schemas/__init__`."""

__all__ = ["process_group", "prompts", "sdpa"]
