"""Load a model directory into a ready-to-run engine state: weights, KV pools sized from the
config, the runner, and the scheduler settings resolved against the model."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dynamo.engine_core.scheduler import Scheduler
from dynamo.pytorch.config import SchedulerSettings, TorchEngineConfig
from dynamo.pytorch.kv_cache import (
    KVBlocks,
    KVCache,
    KVLayout,
    blocks_for_memory,
    convert_blocks,
    dtype_name,
)
from dynamo.pytorch.model import CausalLM, load_weights
from dynamo.pytorch.model_config import ModelConfig
from dynamo.pytorch.runner import ModelRunner
from dynamo.runtime.errors import InvalidArgument

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(slots=True)
class LoadedModel:
    model: CausalLM
    cache: KVCache
    runner: ModelRunner
    settings: SchedulerSettings

    def export_blocks(self, scheduler: Scheduler, block_hashes: list[int]) -> KVBlocks:
        """Step thread only: the leading cached blocks of ``block_hashes`` with their K/V."""
        kv = scheduler.kv
        n = kv.num_cached_prefix(block_hashes)
        hashes = block_hashes[:n]
        locals_ = [kv.local_hash_of(h) for h in hashes]
        data = self.cache.export_slots([kv.slot_of(h) for h in hashes])
        return KVBlocks(
            layout=self.cache.layout, block_hashes=hashes, local_hashes=locals_, data=data
        )

    def import_blocks(
        self,
        scheduler: Scheduler,
        blocks: KVBlocks,
        *,
        announce: bool = True,
        token_ids: list[int] | None = None,
    ) -> int:
        """Step thread only: store ``blocks`` as cached (inactive) blocks; the new ones are
        announced with a Stored event unless ``announce`` is False (a decode worker's received
        prompt). Returns how many were new.

        Blocks in another layout (another block size or dtype, same model) are re-blocked into
        this engine's layout first; that needs the ``token_ids`` they hold (their hashes depend
        on the block size). ``InvalidArgument`` on a layout that cannot be converted or no room."""
        if blocks.layout != self.cache.layout:
            if token_ids is None:
                raise InvalidArgument(
                    f"KV layout {blocks.layout} != this engine's {self.cache.layout}"
                )
            try:
                blocks = convert_blocks(blocks, self.cache.layout, token_ids)
            except ValueError as exc:
                raise InvalidArgument(str(exc)) from None
        kv = scheduler.kv
        hashes = blocks.block_hashes
        if not kv.enable_prefix_caching:
            raise InvalidArgument("importing KV blocks needs prefix caching")
        if len(blocks.local_hashes) != len(hashes):
            raise InvalidArgument("block_hashes and local_hashes differ in length")
        if kv.num_slots_needed(hashes, 0) > kv.num_available_blocks:
            raise InvalidArgument("no room in the KV pool for the imported blocks")
        new = [i for i, h in enumerate(hashes) if not kv.is_cached(h)]
        kv.use(hashes, blocks.local_hashes, announce=announce)
        try:
            self.cache.import_slots([kv.slot_of(h) for h in hashes], blocks.data)
        finally:
            kv.release(hashes, [])
        return len(new)


def load_model(config: TorchEngineConfig) -> LoadedModel:
    """Read config.json and the weights, allocate the KV pools. ``ValueError`` on an
    unsupported or incomplete model directory."""
    if not config.model_path:
        raise ValueError("--model-path is required")
    if config.torch_threads is not None:
        torch.set_num_threads(config.torch_threads)
    if config.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda but torch sees no CUDA device")
    device = torch.device(config.device)
    dtype = _DTYPES[config.dtype]
    mcfg = ModelConfig.from_model_dir(config.model_path)
    max_len = config.context_length or mcfg.max_position_embeddings
    if mcfg.sliding_window is not None:
        max_len = min(max_len, mcfg.sliding_window)
    model = CausalLM(
        mcfg, load_weights(config.model_path), dtype=dtype, device=device, max_positions=max_len
    )
    layout = KVLayout(
        num_layers=mcfg.num_layers,
        block_size=config.block_size,
        num_kv_heads=mcfg.num_kv_heads,
        head_dim=mcfg.head_dim,
        dtype=dtype_name(dtype),
    )
    num_blocks = config.num_gpu_blocks_override or blocks_for_memory(layout, config.kv_cache_memory)
    if num_blocks <= 0:
        raise ValueError("--kv-cache-memory is too small for one KV block")
    cache = KVCache.allocate(layout, num_blocks, device)
    settings = SchedulerSettings(
        block_size=config.block_size,
        num_gpu_blocks=num_blocks,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        enable_prefix_caching=config.enable_prefix_caching,
        enable_chunked_prefill=config.enable_chunked_prefill,
        preemption_mode=config.preemption_mode,
        max_model_len=max_len,
        disaggregation_mode=config.disaggregation_mode,
    )
    return LoadedModel(model, cache, ModelRunner(model, cache, config.block_size), settings)
