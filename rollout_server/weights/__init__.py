"""Weight sync, server side (docs/ARCHITECTURE.md#sync-weights): an update is staged whole before the
engine sees it.

Flow: `validate` checks a `begin`'s manifest against the engine → `staging.SyncStaging` holds the one
staged sync while its buckets come in through the sync's receiver (`receivers`, five verbs: begin, receive,
prepare, commit, abort; an HTTP body or an shm file staged as files, `bucket_files`; or the engine's receive
over the learner's gloo/nccl group) → `prepare` answers once all are in → `commit` hands the update to the
engine's all-or-nothing `apply_update`; abort or timeout drops it.
"""

__all__: list[str] = []
