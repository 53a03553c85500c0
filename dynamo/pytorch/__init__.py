"""The PyTorch engine: a real model behind ``backend.LLMEngine``."""
