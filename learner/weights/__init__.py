"""Weight sync, learner side (docs/ARCHITECTURE.md#weight-sync): when, what and how the policy's weights
reach the rollout engines.

Flow: `sync.WeightSyncPolicy` syncs before an optimizer step's first fresh rollout → `export` yields the
merged full weights (or the PEFT adapter) as a `types.WeightUpdate` → the `RolloutSource` sends it (to
servers through `server_sync.ServerSync`, one `session.SyncSession` per server): begin on every server →
safetensors buckets (`sync_stream`, `codec`) over one of `transports` (`http`, `shm`, `gloo`/`nccl` with
`group_send`'s group) → commit on every server once all hold every bucket, else abort everywhere.
"""

__all__: list[str] = []
