"""Where the learner's rollouts come from, behind one seam (`base.RolloutSource`): rollout servers over HTTP
(`client`, `server_source`) or an in-process engine (`colocate/`), configured by `rollout:` (`config`)."""

__all__: list[str] = []
