"""The vLLM backend: vLLM's ``AsyncLLM`` in-process behind ``backend.LLMEngine``
(``python -m dynamo.vllm --model-path DIR [vLLM engine flags]``; needs the ``vllm`` extra)."""
