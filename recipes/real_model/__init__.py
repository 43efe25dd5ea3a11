"""The DAPO-versus-GRPO study on a small pretrained model (run by `recipes/dapo_real_model.py`): settings (`config`),
held-out scoring with the paged engine (`scoring`), the grid and the regime's candidates (`grid`), the pilot and the
pick (`pilot`), the arms (`arms`), one run (`runs`), the runs on the shared device (`schedule`), the report
(`report`, `tables`, `plots`) and the study in one file (`bundle`)."""
