"""The rollout server process: a FastAPI app (`app.create_app`) that generates rollouts for the learner on
a vLLM or transformers engine and takes its weight updates (`python -m rollout_server`)."""

__all__: list[str] = []
