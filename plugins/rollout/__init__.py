"""Rollout-engine plugins: transformers ``generate`` (hf), vLLM (in-process engine or server) and SGLang."""
