"""The OpenAI-compatible HTTP frontend: preprocess -> route -> transport -> detokenize -> SSE."""
