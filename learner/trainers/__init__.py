"""The HF `Trainer` subclasses and their parts: rollout-matching SFT (`rollout_matching`, its step planner,
overlapped rollouts, callbacks, the strategy report) and the assembly of a run from its config (`build`)."""

__all__: list[str] = []
