"""The engine contract (spec 000) and its runtime integration: LLMEngine, Worker, run."""

from dynamo.backend.engine import EngineConfig, GenerateContext, LLMEngine, chunk

__all__ = ["EngineConfig", "GenerateContext", "LLMEngine", "chunk"]
