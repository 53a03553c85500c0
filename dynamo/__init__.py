"""dynamo-py: a distributed LLM inference serving framework (NVIDIA Dynamo's architecture)."""

__version__ = "0.1.0"
