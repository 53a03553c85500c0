"""Guided decoding: the cost of a token mask, llguidance (used) against xgrammar (candidate).

Trains a byte-level BPE of 32,000 tokens on the Python sources of the virtualenv (a realistic
code/English vocabulary, deterministic), then for each library samples ``--samples`` JSON
objects against a 4-field schema with random logits (compact JSON), timing every mask
computation, the compile of the schema, and whether each output parses. Then times
``GuidedDecoder.apply_masks`` (masks of a whole batch, computed and applied) at batch 1, 8, 32.

xgrammar is optional and deliberately not a project dependency (it pulls torch, triton and
tvm-ffi); to include it, install it aside and put it on the path::

    .venv/bin/pip install --target /tmp/xgr --no-deps xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2
    PYTHONPATH=$PWD:/tmp/xgr .venv/bin/python benchmarks/guided_decoding.py

Writes bench-results/guided_decoding.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import llguidance
import tokenizers
import torch
from tokenizers import decoders, models, pre_tokenizers, trainers

from dynamo.preprocess.tokenizer import Tokenizer
from dynamo.protocol.request import GuidedDecodingOptions
from dynamo.pytorch.guided import GuidedDecoder, apply_token_bitmask_

REPO = Path(__file__).resolve().parent.parent
EOS = 0
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}


def train_tokenizer(vocab: int, corpus_chars: int) -> Tokenizer:
    site = Path(sys.prefix) / "lib"
    texts: list[str] = []
    size = 0
    for path in sorted(site.rglob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        texts.append(text)
        size += len(text)
        if size > corpus_chars:
            break
    raw = tokenizers.Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    raw.train_from_iterator(texts, trainer)
    return Tokenizer(raw)


def percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "n": len(ordered),
        "p50_us": ordered[len(ordered) // 2] * 1e6,
        "p90_us": ordered[int(len(ordered) * 0.9)] * 1e6,
        "p99_us": ordered[int(len(ordered) * 0.99)] * 1e6,
        "mean_us": statistics.fmean(ordered) * 1e6,
    }


def run_samples(
    tokenizer: Tokenizer,
    new_matcher: Callable[[], Any],
    fill: Callable[[Any, torch.Tensor], None],
    accept: Callable[[Any, int], bool],
    done: Callable[[Any], bool],
    words: int,
    samples: int,
) -> dict[str, Any]:
    vocab = tokenizer.vocab_size
    generator = torch.Generator().manual_seed(0)
    bitmask = torch.full((1, words), -1, dtype=torch.int32)
    mask_times: list[float] = []
    compile_times: list[float] = []
    parsed = 0
    for _ in range(samples):
        start = time.perf_counter()
        matcher = new_matcher()
        compile_times.append(time.perf_counter() - start)
        ids: list[int] = []
        while not done(matcher) and len(ids) < 400:
            start = time.perf_counter()
            fill(matcher, bitmask)
            mask_times.append(time.perf_counter() - start)
            logits = torch.randn(1, vocab, generator=generator)
            apply_token_bitmask_(logits, bitmask)
            token = int(torch.multinomial(torch.softmax(logits[0], -1), 1, generator=generator))
            if not accept(matcher, token) or token == EOS:
                break
            ids.append(token)
        try:
            json.loads(tokenizer.decode(ids))
            parsed += 1
        except ValueError:
            pass
    return {
        "mask": percentiles(mask_times),
        "compile_first_ms": compile_times[0] * 1e3,
        "compile_later_ms": statistics.median(compile_times[1:]) * 1e3,
        "parsed": parsed,
        "samples": samples,
    }


def bench_llguidance(tokenizer: Tokenizer, samples: int) -> dict[str, Any]:
    start = time.perf_counter()
    decoder = GuidedDecoder(tokenizer, tokenizer.vocab_size, [EOS])
    setup = time.perf_counter() - start
    options = GuidedDecodingOptions(json=SCHEMA)

    def fresh() -> Any:
        # Compile every time (the cache would hide it): the grammar is built from the options.
        decoder._cache.clear()
        return decoder.matcher(options)

    result = run_samples(
        tokenizer,
        fresh,
        lambda m, bm: m.fill_bitmask(bm, 0),
        lambda m, t: m.accept_token(t),
        lambda m: m.is_terminated(),
        decoder.bitmask_words,
        samples,
    )
    result["tokenizer_setup_s"] = setup
    result["version"] = llguidance.__version__
    return result


def bench_xgrammar(tokenizer: Tokenizer, samples: int) -> dict[str, Any] | None:
    try:
        import xgrammar  # type: ignore[import-not-found]
    except ImportError:
        return None
    start = time.perf_counter()
    info = xgrammar.TokenizerInfo(
        list(tokenizer.byte_table(False)),
        xgrammar.VocabType.RAW,
        vocab_size=tokenizer.vocab_size,
        stop_token_ids=[EOS],
    )
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
    setup = time.perf_counter() - start
    result = run_samples(
        tokenizer,
        lambda: xgrammar.GrammarMatcher(
            compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
        ),
        lambda m, bm: m.fill_next_token_bitmask(bm, 0),
        lambda m, t: m.accept_token(t),
        lambda m: m.is_terminated(),
        (tokenizer.vocab_size + 31) // 32,
        samples,
    )
    result["tokenizer_setup_s"] = setup
    return result


def bench_batch(tokenizer: Tokenizer, batches: list[int], steps: int) -> dict[str, Any]:
    """apply_masks over a batch of json_object matchers (each advanced along its own sample)."""
    decoder = GuidedDecoder(tokenizer, tokenizer.vocab_size, [EOS])
    out: dict[str, Any] = {}
    for batch in batches:
        generator = torch.Generator().manual_seed(batch)
        matchers = [decoder.matcher(GuidedDecodingOptions(json_object=True)) for _ in range(batch)]
        times: list[float] = []
        apply_times: list[float] = []
        bitmask = decoder.allocate_bitmask(batch)
        for _ in range(steps):
            logits = torch.randn(batch, tokenizer.vocab_size, generator=generator)
            spare = logits.clone()
            start = time.perf_counter()
            decoder.apply_masks(logits, list(matchers))
            times.append(time.perf_counter() - start)
            for row, matcher in enumerate(matchers):
                matcher.fill_bitmask(bitmask, row)
            start = time.perf_counter()
            apply_token_bitmask_(spare, bitmask)  # the unpacking and masking alone
            apply_times.append(time.perf_counter() - start)
            tokens = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)
            for row, matcher in enumerate(matchers):
                token = int(tokens[row])
                if token == EOS or not matcher.accept_token(token) or matcher.is_terminated():
                    matchers[row] = decoder.matcher(GuidedDecodingOptions(json_object=True))
        out[str(batch)] = {"total": percentiles(times), "apply_only": percentiles(apply_times)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--samples", type=int, default=50)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", default=str(REPO / "bench-results" / "guided_decoding.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    start = time.perf_counter()
    tokenizer = train_tokenizer(args.vocab, 20_000_000)
    print(
        f"tokenizer: {tokenizer.vocab_size} tokens, trained in {time.perf_counter() - start:.1f}s"
    )
    results: dict[str, Any] = {
        "machine": platform.platform(),
        "vocab": tokenizer.vocab_size,
        "llguidance": bench_llguidance(tokenizer, args.samples),
        "xgrammar": bench_xgrammar(tokenizer, args.samples),
        "apply_masks_batch": bench_batch(tokenizer, [1, 8, 32], args.steps),
    }
    for name in ("llguidance", "xgrammar"):
        r = results[name]
        if r is None:
            print(f"{name}: not installed")
            continue
        m = r["mask"]
        print(
            f"{name}: mask p50 {m['p50_us']:.0f} µs, mean {m['mean_us']:.0f} µs, "
            f"p99 {m['p99_us']:.0f} µs over {m['n']} tokens; compile {r['compile_first_ms']:.1f} "
            f"ms (later {r['compile_later_ms']:.2f} ms); tokenizer set-up "
            f"{r['tokenizer_setup_s']:.2f} s; parsed {r['parsed']}/{r['samples']}"
        )
    for batch, parts in results["apply_masks_batch"].items():
        m, a = parts["total"], parts["apply_only"]
        print(
            f"apply_masks batch {batch}: p50 {m['p50_us']:.0f} µs, mean {m['mean_us']:.0f} µs, "
            f"p99 {m['p99_us']:.0f} µs; of which unpack+mask p50 {a['p50_us']:.0f} µs"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
