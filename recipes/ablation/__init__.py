"""The DAPO ablation study in miniature (run by `recipes/dapo_ablation.py`): config, model, evaluation, variants,
workers, plan and report."""
