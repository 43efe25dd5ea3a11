"""What every benchmark shares: the workload (configs, random-init models, prompts), device-synchronised timing,
measurements in processes of their own, and the result file. It imports none of the other sub-packages."""
