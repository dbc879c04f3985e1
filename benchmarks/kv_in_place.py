"""A concat-form host cache bound in place against gathered, per call and end to end, in one run.

    python benchmarks/kv_in_place.py pairs/smollm2-135m-concat --rows 4 --repeat 4

"gathered" is how batched calls ran before `runtime/kv_room`: the cache laid out for its whole
context, every call copying its rows' pasts into a staging buffer. "in place": neighbouring rows
padded to the cache's room and bound where they are. The two are switched by replacing
`kv_room`'s two policy functions for the duration of a measurement.

1. Per call: `forward_rows` of `--rows` rows after ragged pasts around `--past` positions, a
   verify block (K+1 = 4) and a decode step, medians of `--calls` calls each, the modes
   alternating.
2. End to end: one `ContinuousBatch` per mode and drafting (the pair's draft, and plain
   target-only), kept for the whole run as a server keeps it, one untimed pass each, then
   `--repeat` timed passes over the prompts, the modes alternating which goes first. Every
   pass's tokens are compared with the gathered plain pass's (greedy: equal token for token is
   expected but not guaranteed: padding changes the attention's rounding).
3. The kept KV binding: the same per-call measurement in place, the cache's kept binding of the
   2 x layers pasts and presents used, or dropped before each call (as every call bound them
   before).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from specedge.runtime import kv_room
from specedge.runtime.kvcache import KVCache
from specedge.runtime.pair import GenerationConfig, Pair
from specedge.runtime.prompts import default_prompts
from specedge.runtime.serving import ContinuousBatch

IN_PLACE = (kv_room.padded_past, kv_room.next_room)
GATHERED = (lambda room, fed, contiguous: int(fed.max()),
            lambda room, longest, max_len: max_len)


@contextlib.contextmanager
def mode(name: str) -> Iterator[None]:
    kv_room.padded_past, kv_room.next_room = IN_PLACE if name == "in place" else GATHERED  # type: ignore[assignment]
    try:
        yield
    finally:
        kv_room.padded_past, kv_room.next_room = IN_PLACE


def prefilled(pair: Pair, rows: int, past: int, seed: int) -> tuple[KVCache, np.ndarray]:
    """A target cache of `rows` rows, each row's prompt (ragged, about `past` tokens) fed alone,
    as a batch joins them."""
    model, rng = pair.target, np.random.default_rng(seed)
    lengths = past - rng.integers(0, max(1, past // 8), rows)
    cache = model.new_cache(rows, past + 64)
    for row, n in enumerate(lengths):
        model.feed_rows(cache, np.array([row]), rng.integers(3, model.logits_size, (1, int(n))),
                        np.array([n]))
    return cache, lengths


def alternate(pair: Pair, caches: dict[str, KVCache], before: Callable[[str], Any],
              width: int, calls: int) -> dict[str, float]:
    """Median milliseconds of a `forward_rows` call of every row at `width` new tokens, the
    names of `caches` alternating which goes first; `before(name)` is entered around each."""
    model = pair.target
    rows = next(iter(caches.values())).batch
    tokens = np.random.default_rng(width).integers(3, model.logits_size, (rows, width))
    times: dict[str, list[float]] = defaultdict(list)
    names = list(caches)
    for i in range(calls):
        for name in (names if i % 2 else names[::-1]):
            cache = caches[name]
            with before(name):
                t0 = time.perf_counter()
                model.forward_rows(cache, np.arange(rows), tokens, np.full(rows, width))
                times[name].append(time.perf_counter() - t0)
                cache.rollback(cache.lengths - width)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def per_call(pair: Pair, rows: int, past: int, calls: int) -> None:
    caches = {}
    for name in ("gathered", "in place"):
        with mode(name):
            caches[name], lengths = prefilled(pair, rows, past, seed=0)
    for width in (4, 1):
        ms = alternate(pair, caches, mode, width, calls)
        g, p = ms["gathered"], ms["in place"]
        print(f"per call, {rows} rows x {width} new after pasts {lengths.min()}..{lengths.max()}"
              f" (room {caches['in place'].room}): gathered {g:.2f} ms, in place {p:.2f} ms, "
              f"{g / p:.3f}x", flush=True)


def kept_binding(pair: Pair, rows: int, past: int, calls: int) -> None:
    cache = prefilled(pair, rows, past, seed=1)[0]

    @contextlib.contextmanager
    def binding(name: str) -> Iterator[None]:
        if name == "dropped":
            cache.host_binding = None
        yield

    for width in (4, 1):
        ms = alternate(pair, {"dropped": cache, "kept": cache}, binding, width, calls)
        d, k = ms["dropped"], ms["kept"]
        print(f"binding, {rows} rows x {width} new in place: bound anew {d:.2f} ms, kept "
              f"{k:.2f} ms, {d / k:.3f}x", flush=True)


def run_pass(server: ContinuousBatch, prompts: list[str], config: GenerationConfig
             ) -> tuple[float, list[list[int]]]:
    ids = [server.submit(p, config) for p in prompts]
    results = {}
    start = time.perf_counter()
    while server.busy:
        results.update(server.step())
    elapsed = time.perf_counter() - start
    tokens = [results[i].tokens for i in ids]
    return sum(len(t) for t in tokens) / elapsed, tokens


def end_to_end(pair: Pair, rows: int, prompts: list[str], config: GenerationConfig,
               repeat: int) -> None:
    servers = {}
    for name in ("gathered", "in place"):
        for drafting, drafter in (("spec", None), ("plain", "none")):
            with mode(name):
                server = ContinuousBatch(pair, capacity=rows, drafter=drafter)
                run_pass(server, prompts, config)  # the warm-up: untimed
            servers[name, drafting] = server
    rates: dict[tuple[str, str], list[float]] = defaultdict(list)
    reference: list[list[int]] | None = None
    for rep in range(repeat):
        order = ("gathered", "in place") if rep % 2 else ("in place", "gathered")
        for drafting in ("spec", "plain"):
            for name in order:
                with mode(name):
                    rate, tokens = run_pass(servers[name, drafting], prompts, config)
                if reference is None:
                    with mode("gathered"):
                        reference = run_pass(servers["gathered", "plain"], prompts, config)[1]
                same = sum(a == b for a, b in zip(tokens, reference, strict=True))
                rates[name, drafting].append(rate)
                print(f"{drafting:5} {name:8} pass {rep}: {rate:6.1f} tok/s, equal to gathered "
                      f"plain {same}/{len(tokens)}", flush=True)
    for drafting in ("spec", "plain"):
        g = statistics.median(rates["gathered", drafting])
        p = statistics.median(rates["in place", drafting])
        print(f"median {drafting}: gathered {g:.1f} tok/s, in place {p:.1f} tok/s, {p / g:.3f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pair", help="a --graph concat pair folder")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--past", type=int, default=200)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=4)
    ap.add_argument("--providers", default="cpu")
    args = ap.parse_args()
    pair = Pair.load(args.pair, providers=args.providers)
    print(f"{args.pair}: {args.rows} rows, {args.providers}")
    for past in (args.past, 4 * args.past):
        per_call(pair, args.rows, past, args.calls)
    kept_binding(pair, args.rows, args.past, 2 * args.calls)
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, chat=True)
    end_to_end(pair, args.rows, list(default_prompts()[:args.prompts]), config, args.repeat)


if __name__ == "__main__":
    main()
