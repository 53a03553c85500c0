"""``ModelRunner``: turns a scheduled batch into tensors, runs the model over the paged KV pool
and samples the entries that reached the end of their known tokens.

Row layout of one pass (entries in batch order, each its ``n`` new tokens)::

    rows:   | seq A chunk (n_A) | seq B decode (1) | seq C decode (1) | ...
    logits: the last row of each sampling entry only
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dynamo.engine_core.kv_manager import KVManager
from dynamo.engine_core.scheduler import ScheduledBatch
from dynamo.pytorch.attention import AttentionMetadata, PrefillSpan, decode_rows
from dynamo.pytorch.kv_cache import KVCache
from dynamo.pytorch.model import CausalLM
from dynamo.pytorch.sampler import RequestSampler, Sampled, SampleRow, sample


@dataclass(slots=True)
class _Inputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_rows: torch.Tensor
    """The sampling rows, then the prompt-logprob rows."""
    sampling: list[int]
    """Entry index of each sampling row."""
    prompt_targets: list[tuple[str, int]]
    """Per prompt-logprob row: the request and the next prompt token (whose logprob it is)."""


class ModelRunner:
    """Runs passes for one scheduler. Used only from the engine's step thread."""

    def __init__(self, model: CausalLM, cache: KVCache, block_size: int) -> None:
        self.model = model
        self.cache = cache
        self.block_size = block_size
        self.device = model.device

    @torch.inference_mode()
    def run(
        self,
        batch: ScheduledBatch,
        kv: KVManager,
        samplers: dict[str, RequestSampler],
    ) -> list[Sampled | None]:
        """Compute the batch; return one sample per entry (None for a non-final prefill
        chunk)."""
        inputs = self._prepare(batch, kv, samplers)
        logits = self.model.forward(
            inputs.input_ids, inputs.positions, inputs.meta, self.cache.pools, inputs.logits_rows
        )
        if inputs.prompt_targets:
            _record_prompt_logprobs(logits[len(inputs.sampling) :], inputs.prompt_targets, samplers)
            logits = logits[: len(inputs.sampling)]
        rows = []
        for i in inputs.sampling:
            seq = batch.entries[i][0]
            rows.append(
                SampleRow(
                    samplers[seq.request_id],
                    seq.prompt,  # read only, as the sequence's own lists
                    seq.output,
                )
            )
        out: list[Sampled | None] = [None] * len(batch.entries)
        for i, result in zip(inputs.sampling, sample(logits, rows), strict=True):
            out[i] = result
        return out

    def _prepare(
        self, batch: ScheduledBatch, kv: KVManager, samplers: dict[str, RequestSampler]
    ) -> _Inputs:
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        write_slots: list[int] = []
        write_rows: list[int] = []
        prefills: list[PrefillSpan] = []
        decode_row_ids: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        logits_rows: list[int] = []
        sampling: list[int] = []
        prompt_rows: list[int] = []
        prompt_targets: list[tuple[str, int]] = []
        for index, (seq, n) in enumerate(batch.entries):
            start, row = seq.num_computed_tokens, len(ids)
            end = start + n
            table = kv.block_table(seq.full_blocks, seq.unique_blocks)
            ids.extend(seq.tokens(start, end))
            positions.extend(range(start, end))
            # Positions inside full (shared, already computed) blocks keep their cached K/V:
            # only the recomputed last token of a fully cached prompt falls there.
            first_private = len(seq.full_blocks) * bs
            for k, p in enumerate(range(start, end)):
                if p >= first_private:
                    write_rows.append(row + k)
                    write_slots.append(table[p // bs] * bs + p % bs)
            num_blocks = -(-end // bs)
            if n == 1:
                decode_row_ids.append(row)
                decode_tables.append(table[:num_blocks])
                decode_lens.append(end)
            else:
                prefills.append(self._prefill_span(row, n, end, table[:num_blocks]))
            if ScheduledBatch.samples(seq, n):
                logits_rows.append(row + n - 1)
                sampling.append(index)
            acc = samplers[seq.request_id].prompt_logprobs
            if acc is not None:  # rows whose next token is a prompt token not yet scored
                for p in range(max(start, len(acc) - 1), min(end, seq.num_prompt_tokens - 1)):
                    prompt_rows.append(row + p - start)
                    prompt_targets.append((seq.request_id, seq.prompt[p + 1]))
        dev = self.device
        all_written = len(write_rows) == len(ids)
        meta = AttentionMetadata(
            write_slots=torch.tensor(write_slots, dtype=torch.int64, device=dev),
            write_rows=None
            if all_written
            else torch.tensor(write_rows, dtype=torch.int64, device=dev),
            prefills=prefills,
            decode=None,
        )
        if decode_row_ids:
            cfg = self.model.config
            meta.decode = decode_rows(
                decode_row_ids,
                decode_tables,
                decode_lens,
                block_size=bs,
                kv_heads=cfg.num_kv_heads,
                group=cfg.num_heads // cfg.num_kv_heads,
                dtype=self.model.dtype,
                device=dev,
            )
        return _Inputs(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            meta=meta,
            logits_rows=torch.tensor(logits_rows + prompt_rows, dtype=torch.int64, device=dev),
            sampling=sampling,
            prompt_targets=prompt_targets,
        )

    def _prefill_span(self, row: int, n: int, end: int, table: list[int]) -> PrefillSpan:
        dev = self.device
        mask = None
        if end > n:  # a cached prefix: query i (position end - n + i) sees keys <= it
            q = torch.arange(n, device=dev).unsqueeze(1) + (end - n)
            mask = torch.arange(end, device=dev).unsqueeze(0) <= q
        return PrefillSpan(
            start=row,
            num_queries=n,
            context_len=end,
            block_table=torch.tensor(table, dtype=torch.int64, device=dev),
            mask=mask,
        )


def _record_prompt_logprobs(
    logits: torch.Tensor, targets: list[tuple[str, int]], samplers: dict[str, RequestSampler]
) -> None:
    """Append each row's log-probability of its next prompt token (raw logits)."""
    index = torch.tensor([t for _, t in targets], dtype=torch.int64, device=logits.device)
    values = torch.log_softmax(logits, dim=-1).gather(1, index.unsqueeze(1)).squeeze(1)
    for (request_id, _), value in zip(targets, values.tolist(), strict=True):
        acc = samplers[request_id].prompt_logprobs
        assert acc is not None
        acc.append(value)
