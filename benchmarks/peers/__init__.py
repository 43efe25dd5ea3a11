"""The paged engine beside what TRL users run instead (vLLM, transformers' continuous batching): one process per
engine and shape on the same checkpoint, prompts and lengths. It imports `core` and `rollout`'s measurements."""
