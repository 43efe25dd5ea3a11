"""The DAPO ablation study (run by `recipes/dapo_ablation.py`): config and regimes, the addition task and its scoring
by the package's held-out evaluator, model, variants, workers, the records they share (`store.py`), the regime
check, plan and report."""
