"""The PyTorch engine: Hugging Face causal LMs of the Llama layout (Llama, Mistral, Qwen2,
Qwen3) on plain torch ops, with a paged KV pool, continuous batching and prefix caching on the
shared engine core. Needs the ``pytorch`` extra (torch); nothing outside this package imports
torch. ``python -m dynamo.pytorch --model-path DIR`` serves it."""
