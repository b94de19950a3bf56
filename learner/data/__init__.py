"""Training data shared by SFT and GRPO: records and datasets, the chat messages built from a record, and
the prompt encoding that generation and teacher forcing share."""

__all__: list[str] = []
