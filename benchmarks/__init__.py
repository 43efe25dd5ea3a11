"""trl-dapo's benchmarks, in sub-packages by concern: `core` under all of them, `rollout`, `trainer`, `peers`,
`multi_gpu`, and the GPU `kit` (`README.md` here lists every module; `tests/test_benchmark_layout.py` holds the
imports to one way)."""
