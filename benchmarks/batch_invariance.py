"""Is a target's greedy output the same when it verifies several tokens per call?

Speculative decoding reproduces target-only output token for token only if the target gives the
same logits for a position whether it computes it alone (a decode step) or inside a block of K+1
(a verification). One-row and several-row calls round differently (~1e-5 logits in fp32), and
int8 activation quantization (MatMulNBits at accuracy level 4) amplifies that to ~0.6 logits;
several-row calls agree bit for bit. specedge's two-row steps (`Pair.load(two_row_steps=...)`,
on when the load-time probe finds this) run every step with at least two rows.

Usage: python benchmarks/batch_invariance.py PAIR [PAIR ...] [--prompts 44] [--k 3]
           [--accuracy-level 1] [--steps one,two,auto]

For each pair (and, with --accuracy-level, a copy of it whose MatMulNBits nodes use that level)
and each way of running one-token steps (one row, two rows, or what the probe picks): the
largest logit difference between a (K+1)-token block and the same tokens one by one, and how
many greedy generations of n-gram speculation (fixed K) equal target-only, with decode tok/s of
both. Prints a markdown table; the modes of one pair run interleaved prompt by prompt.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent

from specedge.runtime.pair import GenerationConfig, Pair  # noqa: E402


def with_accuracy_level(pair: Path, level: int, out: Path) -> Path:
    """A copy of `pair` whose target's MatMulNBits nodes run at `level` (the manifest's hash of
    model.onnx is updated)."""
    import hashlib

    import onnx
    from onnx import helper

    shutil.copytree(pair, out)
    manifest = json.loads((pair / "specedge.json").read_text())
    target = manifest["models"]["target"]
    src = pair / target["path"]
    model = onnx.load(str(src), load_external_data=False)
    count = 0
    for node in model.graph.node:
        if node.op_type == "MatMulNBits":
            kept = [a for a in node.attribute if a.name != "accuracy_level"]
            del node.attribute[:]
            node.attribute.extend(kept + [helper.make_attribute("accuracy_level", level)])
            count += 1
    dst = out / target["path"]
    dst.unlink()
    onnx.save(model, str(dst))
    target["files"][target["path"]] = hashlib.sha256(dst.read_bytes()).hexdigest()
    (out / "specedge.json").write_text(json.dumps(manifest, indent=2))
    print(f"{out}: accuracy_level {level} on {count} MatMulNBits nodes", file=sys.stderr)
    return out


def block_vs_steps(pair: Pair, ids: list[int], k: int) -> float:
    """Max |logit difference| between feeding ids[-(k+1):] as one block and one at a time."""
    t = pair.target
    head, block = np.asarray([ids[:-(k + 1)]]), np.asarray([ids[-(k + 1):]])
    a = t.new_cache(1, len(ids) + 1)
    t.forward(a, head)
    whole = t.forward(a, block)[0]
    b = t.new_cache(1, len(ids) + 1)
    t.forward(b, head)
    steps = np.concatenate([t.forward(b, block[:, i:i + 1])[0] for i in range(k + 1)])
    return float(np.abs(whole - steps).max())


STEPS = {"one": False, "two": True, "auto": None}


def check(pair_dir: Path, modes: list[str], prompts: list[str], k: int, max_new: int
          ) -> dict[str, dict[str, float]]:
    """Per mode: exact count, logit differences and tok/s; the modes take turns per prompt
    (the same pair loaded once per mode), so drift on this machine hits them alike."""
    pairs = {m: Pair.load(pair_dir, load_draft=False, verify_hashes=False,
                          two_row_steps=STEPS[m]) for m in modes}
    any_pair = next(iter(pairs.values()))
    ids = [any_pair.encode_prompt(p, chat=True) for p in prompts]
    base = GenerationConfig(max_new_tokens=max_new, drafter="none")
    spec = GenerationConfig(max_new_tokens=max_new, drafter="ngram", num_draft_tokens=k,
                            adaptive=False)
    acc = {m: {"same": 0, "t_base": 0.0, "n_base": 0, "t_spec": 0.0, "n_spec": 0, "diffs": []}
           for m in modes}
    for pair in pairs.values():
        pair.generate_ids(ids[0], base)
    for prompt in ids:
        for m, pair in pairs.items():
            r = acc[m]
            a, _, sa = pair.generate_ids(prompt, base)
            b, _, sb = pair.generate_ids(prompt, spec)
            r["same"] += a == b
            r["t_base"] += sa.decode_s
            r["n_base"] += sa.new_tokens
            r["t_spec"] += sb.decode_s
            r["n_spec"] += sb.new_tokens
            r["diffs"].append(block_vs_steps(pair, prompt + a[:16], k))
    out = {}
    for m, pair in pairs.items():
        r = acc[m]
        out[f"{m}: {pair.target.steps_note()}"] = {
            "same": r["same"], "n": len(ids), "max_diff": max(r["diffs"]),
            "median_diff": float(np.median(r["diffs"])), "base": r["n_base"] / r["t_base"],
            "spec": r["n_spec"] / r["t_spec"]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pairs", nargs="+", type=Path)
    ap.add_argument("--prompts", type=int, default=44)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--accuracy-level", type=int, default=None)
    ap.add_argument("--steps", default="auto",
                    help="comma-separated: one (one-row steps), two (two-row steps), auto "
                         "(what the load-time probe picks)")
    args = ap.parse_args()
    modes = args.steps.split(",")
    if not modes or any(m not in STEPS for m in modes):
        ap.error("--steps takes one, two or auto, comma-separated")
    prompts = [json.loads(line)["prompt"] for line in (HERE / "prompts.jsonl").read_text()
               .splitlines() if line.strip()][: args.prompts]
    tmp = Path(tempfile.mkdtemp(prefix="specedge-invariance-"))
    runs = []
    for pair in args.pairs:
        manifest = json.loads((pair / "specedge.json").read_text())["models"]["target"]
        runs.append((f"{pair} ({manifest['precision']})", pair))
        if args.accuracy_level is not None and manifest["precision"] in ("int4", "int8"):
            copy = with_accuracy_level(pair, args.accuracy_level, tmp / pair.name)
            runs.append((f"{pair} ({manifest['precision']}, accuracy_level "
                         f"{args.accuracy_level})", copy))
    print(f"# batch invariance, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: "
          f"{args.prompts} prompts x {args.max_new_tokens} tokens, n-gram K={args.k}")
    print(f"| target | steps | n-gram K={args.k} greedy == target-only | max / median logit "
          f"diff, block of {args.k + 1} vs steps | target-only tok/s | n-gram tok/s |")
    print("|---|---|---|---|---|---|")
    for label, path in runs:
        for mode, r in check(path, modes, prompts, args.k, args.max_new_tokens).items():
            print(f"| {label} | {mode} | {r['same']}/{r['n']} | {r['max_diff']:.2e} / "
                  f"{r['median_diff']:.2e} | {r['base']:.1f} | {r['spec']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
