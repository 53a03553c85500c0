"""vLLM's own offline ``LLM.generate`` on a model, greedy: the reference the HTTP tests compare
with. Run as a child process (``python -m tests.vllm.offline_greedy MODEL MAX_TOKENS``, prompts
as a JSON list of token-id lists on stdin); prints one JSON line ``{"outputs": [[ids], ...]}``.
The engine flags are those of the workers under test (``WORKER_FLAGS``)."""

from __future__ import annotations

import json
import sys

BLOCK_SIZE = 32
MAX_MODEL_LEN = 512


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    model, max_tokens = sys.argv[1], int(sys.argv[2])
    prompts: list[list[int]] = json.loads(sys.stdin.read())
    llm = LLM(
        model=model,
        dtype="float32",
        block_size=BLOCK_SIZE,
        max_model_len=MAX_MODEL_LEN,
        enforce_eager=True,
        num_gpu_blocks_override=64,
    )
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
    print(json.dumps({"outputs": [list(o.outputs[0].token_ids) for o in outs]}), flush=True)


if __name__ == "__main__":
    main()
