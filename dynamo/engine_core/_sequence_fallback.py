"""Pure-Python twin of ``dynamo.engine_core._sequence`` (contract: ``_sequence.pyi``), used where
the extension is not built or ``DYN_NATIVE=0``; the native ``new_sequence`` also hands this one
any call it does not take itself (an unusual argument type, a request it refuses: the errors are
raised here). Import through ``dynamo.engine_core.sequence``."""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from types import MemberDescriptorType, ModuleType
from typing import TYPE_CHECKING, Any, TypeVar

from dynamo.router.hashing import block_seed, local_block_hashes, sequence_hashes
from dynamo.runtime.errors import InvalidArgument

if TYPE_CHECKING:
    from dynamo.engine_core.config import SchedulerLimits
    from dynamo.engine_core.sequence import Sequence
    from dynamo.protocol.disagg import DisaggregatedParams

T = TypeVar("T")

_MASK64 = (1 << 64) - 1
_NO_IDS: frozenset[int] = frozenset()
_sequence_module: ModuleType | None = None  # dynamo.engine_core.sequence (it imports this one)


def build(cls: type[T], values: tuple[Any, ...]) -> T:
    names = getattr(cls, "__slots__", None)
    if isinstance(names, str) or names is None:
        raise TypeError("build() needs a class of plain object slots")
    names = tuple(names)
    for name in names:
        if not isinstance(getattr(cls, name, None), MemberDescriptorType):
            raise TypeError("build() needs a class of plain object slots")
    if len(values) != len(names):
        raise ValueError("build() needs one value per slot")
    obj = object.__new__(cls)
    for name, value in zip(names, values, strict=True):
        object.__setattr__(obj, name, value)
    return obj


def new_sequence(
    config: SchedulerLimits,
    token_ids: list[int] | array[int],
    request_id: str,
    now: float,
    *,
    max_tokens: int | None,
    min_tokens: int = 0,
    stop_token_ids: Iterable[int] = (),
    eos_token_ids: Iterable[int] = (),
    ignore_eos: bool = False,
    lora_name: str | None = None,
    seed: int | None = None,
    handoff: DisaggregatedParams | None = None,
    reuse_prefix_cache: bool = True,
    seed_id: str | None = None,
    hashes: tuple[list[int], list[int]] | None = None,
) -> Sequence:
    global _sequence_module
    if _sequence_module is None:
        import dynamo.engine_core.sequence as module

        _sequence_module = module
    s = _sequence_module
    isl = len(token_ids)
    if isl == 0:
        raise InvalidArgument("the prompt is empty")
    room = config.max_model_len - isl
    if room < 1:
        raise InvalidArgument(f"a prompt of {isl} tokens leaves no room in the context")
    if config.disaggregation_mode == "prefill":
        max_tokens, min_tokens = 1, 0
    elif max_tokens is None:
        max_tokens = room
    if max_tokens < 1:
        raise InvalidArgument("max_tokens must be at least 1")
    if max_tokens > room:
        raise InvalidArgument(
            f"prompt ({isl}) + max_tokens ({max_tokens}) exceeds the context length "
            f"({config.max_model_len})"
        )
    if min_tokens > max_tokens:
        raise InvalidArgument("min_tokens exceeds max_tokens")
    kv_tokens = isl + max_tokens - 1  # the last sampled token never needs a KV slot
    if -(-kv_tokens // config.block_size) > config.num_gpu_blocks:
        raise InvalidArgument(
            f"the request needs {kv_tokens} KV tokens; the pool holds {config.total_kv_tokens}"
        )
    if not config.enable_chunked_prefill and isl > config.max_num_batched_tokens:
        raise InvalidArgument(
            f"a prompt of {isl} tokens exceeds max_num_batched_tokens "
            f"({config.max_num_batched_tokens}) and chunked prefill is off"
        )
    eos = frozenset(eos_token_ids) if eos_token_ids else _NO_IDS
    stop_ids = frozenset(stop_token_ids) if stop_token_ids else _NO_IDS
    if config.disaggregation_mode != "decode":
        handoff = None
    bs = config.block_size
    if hashes is not None and len(hashes[0]) == isl // bs:
        local, chained = hashes  # handed over: the output's blocks are appended to them
    else:  # not handed in: hashed as Sequence.__post_init__ does
        local = local_block_hashes(token_ids, bs, lora_name=lora_name)
        chained = sequence_hashes(local)
    # Sequence(...) without its __init__ and __post_init__: every field in order, as they
    # would set it (tests/unit/engine_core/test_sequence_native.py).
    cls: type[Sequence] = s.Sequence
    return build(
        cls,
        (
            request_id,
            token_ids if _kept(token_ids) else list(token_ids),  # prompt
            isl,
            max_tokens,
            min_tokens,
            bs,
            lora_name,
            s.request_seed(seed_id or request_id, seed) & _MASK64,
            stop_ids if ignore_eos else stop_ids | eos,
            eos,
            now,
            handoff,
            handoff is not None,  # pending_transfer
            reuse_prefix_cache,
            s.SequenceStatus.WAITING,
            0,  # num_computed_tokens
            0,  # prefill_end
            None,  # num_cached_tokens
            0.0,  # ready_at
            0,  # num_preemptions
            None,  # finish_reason
            [],  # output
            local,
            chained,
            [],  # full_blocks
            [],  # unique_blocks
            block_seed(lora_name),  # hash_seed
            None,  # full_slots
        ),
    )


def _kept(token_ids: object) -> bool:
    """Whether a prompt is kept as handed in: a list, or a packed one (an ``array('I')``, the
    offline replay's); anything else is copied into a list."""
    return type(token_ids) is list or (type(token_ids) is array and token_ids.typecode == "I")
