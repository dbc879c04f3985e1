"""Host time of a greedy batched round's argmax: the runtime's former path (fp16 converted to
float32, a float64 finiteness sum over the fed positions, argmax) against `runtime/host_argmax`
(fp16 on int16 order keys; a per-position max/min finiteness check), on logits shaped as a batch
verifies them: B rows x (K+1) positions x the vocabulary.

    python benchmarks/host_argmax.py [--vocab 152064,49152] [--shapes 1x1,1x4,8x1,8x3,16x5]
                                     [--dtypes float16,float32]

The GPU runs (docs/results/gpu_findings.md) copy fp16 logits of blocks, prefills and batches
to the host; this is the host's share of such a round. CPU only, no model.
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np

from specedge.runtime import host_argmax


def former_path(logits: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """What the runtime did before session 15."""
    host = logits.astype(np.float32) if logits.dtype == np.float16 else logits
    if not math.isfinite(float(host[valid].sum(dtype=np.float64))):
        raise ValueError("not finite")
    return host.argmax(-1)


def keys_path(logits: np.ndarray, valid: np.ndarray) -> np.ndarray:
    keys = host_argmax.order_keys(logits)
    if not host_argmax.finite_at(keys, valid):
        raise ValueError("not finite")
    return host_argmax.argmax(keys)


def best_ms(fn: object, *args: object, reps: int = 15) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn(*args)  # type: ignore[operator]
        times.append(time.perf_counter() - t)
    return 1000 * min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", default="152064,49152")
    ap.add_argument("--shapes", default="1x1,1x4,8x1,8x3,16x5", help="BxP: rows x positions")
    ap.add_argument("--dtypes", default="float16,float32")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    print("| logits | vocabulary | B x positions | former path ms | host_argmax ms | speed-up |")
    print("|---|---|---|---|---|---|")
    for dtype in args.dtypes.split(","):
        for vocab in (int(v) for v in args.vocab.split(",")):
            for shape in args.shapes.split(","):
                b, p = (int(x) for x in shape.split("x"))
                logits = (rng.standard_normal((b, p, vocab)) * 4).astype(dtype)
                valid = np.ones((b, p), bool)
                assert np.array_equal(former_path(logits, valid), keys_path(logits, valid))
                old = best_ms(former_path, logits, valid)
                new = best_ms(keys_path, logits, valid)
                print(f"| {dtype} | {vocab} | {b} x {p} | {old:.2f} | {new:.2f} "
                      f"| {old / new:.1f}x |")


if __name__ == "__main__":
    main()
