"""The server's generation engines behind one narrow protocol (`base.Engine`): `hf.HfEngine`,
`vllm/`'s `VllmEngine` and `group.EngineGroup` (data parallel); `factory` builds the configured one."""

__all__: list[str] = []
