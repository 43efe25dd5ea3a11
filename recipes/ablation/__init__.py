"""The DAPO ablation study (run by `recipes/dapo_ablation.py`): config and regimes, model, evaluation, variants,
workers, the regime check, plan and report."""
