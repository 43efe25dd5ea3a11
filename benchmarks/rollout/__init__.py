"""The paged rollout engine measured: its speed beside HF `generate`, where a decode step's time goes, its decode
attention, its logprobs' gap to the training forward, a real pretrained model, and what generating costs the training
step after it. It imports `core` alone."""
