"""The DAPO-versus-GRPO study on a small pretrained model (run by `recipes/dapo_real_model.py`): settings, held-out
scoring with the paged engine, the task grid and its pick, the runs, and the report."""
