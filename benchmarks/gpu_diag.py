"""Diagnostics for what the first GPU check found (docs/results/gpu_h200.md), one phase per
process; `scripts/gpu_check.sh --diag` runs them after building the pairs they need.

Usage: python benchmarks/gpu_diag.py PHASE --work DIR --out DIR [--cpu-smoke] [--deadline T]

Phases (each writes WORK/parts/diag-<phase>.json; `report` writes OUT/gpu_diag.{md,json}):
  profile  ONNX Runtime's own profile of a short generation: per model, mean run time and the
           operators by provider (nodes on the CPU, memory copies) of the reference pair
           (gqa-shared, fp16) and its concat-form counterpart (fp32, KV cache on the device)
  rounds   where a generation's time goes: every model run and greedy-head run timed, by model
           and block width, against the generation's wall time (target-only, K=1, K=3; plain
           runs and CUDA graphs)
  exact    the row probe at pasts of 4..128 tokens (a one-token step against the same position
           in blocks of 2 and 3), and greedy K=3 against target-only on 20 prompts with one-token
           steps run as one row and as two rows
  tf32     batched greedy rows (B=8) against their batch-1 runs on the concat-form pair, with
           TF32 off (the default now) and on
  nan      where a random-weight fp16 pair's logits are not finite (prefill and a step, target
           and draft), and whether its generations run now

--cpu-smoke runs the same code on the CPU with the tiny fixture pairs (not GPU figures).
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_batch  # noqa: E402
import gpu_plan as gp  # noqa: E402

PROMPTS = 4  # per setting in `rounds` and `profile`


def reference(plan: gp.Plan) -> gp.PairInfo:
    return gp.pairs(plan)[0]


def concat_reference(plan: gp.Plan) -> gp.PairInfo:
    return gpu_batch.batch_pairs(plan)[0]


def random_pair(plan: gp.Plan) -> gp.PairInfo:
    return gp.pairs(plan)[1]


def need(plan: gp.Plan, info: gp.PairInfo, name: str) -> bool:
    if gp.wait_for(info.folder, plan, reserve=10):
        return True
    gp.write_part(plan, f"diag-{name}", {"error": f"{info.folder} was not built"})
    print(f"diag {name}: {info.folder} was not built")
    return False


def greedy(new: int, k: int | None, adaptive: bool = False) -> Any:
    from specedge.runtime.pair import GenerationConfig

    if k is None:
        return GenerationConfig(max_new_tokens=new, drafter="none")
    return GenerationConfig(max_new_tokens=new, drafter="model", num_draft_tokens=k,
                            adaptive=adaptive)


# ----------------------------------------------------------------------------- profile


def phase_profile(plan: gp.Plan) -> None:
    from specedge.runtime import sessions

    prof_dir = plan.work / "profiles"
    prof_dir.mkdir(parents=True, exist_ok=True)
    plain = sessions.session_options

    def profiled(config: Any) -> Any:
        options = plain(config)
        options.enable_profiling = True
        options.profile_file_prefix = str(prof_dir / f"p{time.monotonic_ns()}")
        return options

    sessions.session_options = profiled  # type: ignore[assignment]
    result: dict[str, Any] = {}
    for label, info, cfg in (("gqa-shared fp16, K=3", reference(plan), greedy(32, 3)),
                             ("concat fp32, device KV, target-only", concat_reference(plan),
                              greedy(32, None))):
        if plan.left() < 15 or not gp.ready(info.folder):
            result[label] = {"error": "not built or no time left"}
            continue
        try:
            pair = gp.load_variant(info.folder, plan, {})
            ids = gp.prompt_ids(info, 2)
            for prompt in ids:
                pair.generate_ids(prompt, cfg)
            models = {"target": pair.target, "draft": pair.draft if cfg.drafter != "none"
                      else None}
            result[label] = {name: summarize_profile(Path(m.session.end_profiling()))
                             for name, m in models.items() if m is not None}
        except Exception as exc:  # reported, the other pair still runs
            result[label] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        gp.write_part(plan, "diag-profile", result)
    sessions.session_options = plain  # type: ignore[assignment]
    for label, models in result.items():
        for name, s in models.items():
            if isinstance(s, dict):
                print(f"profile {label} {name}: {s.get('runs')} runs, mean "
                      f"{s.get('mean_run_ms', 0):.2f} ms; cpu nodes {s.get('cpu_nodes')}; "
                      f"top {s.get('top', [])[:3]}")


def summarize_profile(path: Path) -> dict[str, Any]:
    """A session profile's runs and its operators by provider (ONNX Runtime's JSON events:
    cat "Session" name "model_run", cat "Node" with args op_name / provider, dur in us)."""
    events = json.loads(path.read_text())
    runs = [e["dur"] for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"]
    by_op: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    cpu_nodes: set[str] = set()
    for e in events:
        args = e.get("args") or {}
        if e.get("cat") != "Node" or "op_name" not in args:
            continue
        provider = str(args.get("provider", "?")).replace("ExecutionProvider", "")
        by_op[(str(args["op_name"]), provider)].append(float(e.get("dur", 0)))
        if provider == "CPU":
            cpu_nodes.add(str(args["op_name"]))
    n = max(1, len(runs))
    top = sorted(((sum(d) / n / 1000, op, prov, len(d) // n) for (op, prov), d in by_op.items()),
                 reverse=True)
    return {"runs": len(runs), "mean_run_ms": sum(runs) / n / 1000 if runs else 0.0,
            "node_ms_per_run": sum(sum(d) for d in by_op.values()) / n / 1000,
            "cpu_nodes": sorted(cpu_nodes),
            "top": [f"{op}@{prov} x{count}: {ms:.3f} ms/run" for ms, op, prov, count in top[:12]]}


# ----------------------------------------------------------------------------- rounds


def instrument(pair: Any) -> list[tuple[str, str, int, float]]:
    """Time every model run (`OrtModel._step`) and greedy-head run of `pair` into the returned
    list: (model, "run" | "head", block width, seconds)."""
    calls: list[tuple[str, str, int, float]] = []
    for name, model in (("target", pair.target), ("draft", pair.draft)):
        if model is None:
            continue

        def step(cache: Any, tokens: Any, _inner: Any = model._step, _name: str = name) -> Any:
            t = time.perf_counter()
            out = _inner(cache, tokens)
            calls.append((_name, "run", int(tokens.shape[1]), time.perf_counter() - t))
            return out

        model._step = step
        if model.head is not None:
            def head(logits: Any, keep: Any, _inner: Any = model.head.run,
                     _name: str = name) -> Any:
                t = time.perf_counter()
                out = _inner(logits, keep)
                calls.append((_name, "head", int(logits.shape()[1]), time.perf_counter() - t))
                return out

            model.head.run = head
    return calls


def phase_rounds(plan: gp.Plan) -> None:
    info = reference(plan)
    if not need(plan, info, "rounds"):
        return
    ids = gp.prompt_ids(info, PROMPTS)
    variant = "cuda graphs" if plan.provider == "cuda" else "fixed buffers"
    result: dict[str, Any] = {"pair": str(info.folder)}
    for vlabel, fields in (("plain runs", {}), (variant, gp.variants(plan)[variant])):
        pair = gp.load_variant(info.folder, plan, fields)
        calls = instrument(pair)
        for klabel, k in (("target-only", None), ("K=1", 1), ("K=3", 3)):
            if plan.left() < 10:
                break
            cfg = greedy(plan.check_new, k)
            pair.generate_ids(ids[0][:16], cfg)  # warm-up (widths, graphs)
            calls.clear()
            wall = decode = 0.0
            rounds = tokens = 0
            for prompt in ids:
                t = time.perf_counter()
                _, _, st = pair.generate_ids(prompt, cfg)
                wall += time.perf_counter() - t
                decode += st.decode_s
                rounds += st.rounds or max(0, st.new_tokens - 1)
                tokens += st.new_tokens
            table: dict[str, list[float]] = collections.defaultdict(list)
            for model, kind, width, seconds in calls:
                table[f"{model} {kind} w={width}"].append(seconds)
            timed = sum(s for *_, s in calls)
            result[f"{vlabel}, {klabel}"] = {
                "wall_ms": 1000 * wall, "decode_ms": 1000 * decode, "rounds": rounds,
                "tokens": tokens, "ms_per_round": 1000 * decode / max(1, rounds),
                "untimed_ms_per_round": 1000 * (wall - timed) / max(1, rounds),
                "calls": {key: {"count": len(v), "mean_ms": 1000 * sum(v) / len(v)}
                          for key, v in sorted(table.items())}}
            r = result[f"{vlabel}, {klabel}"]
            print(f"rounds {vlabel}, {klabel}: {r['ms_per_round']:.2f} ms/round, untimed "
                  f"{r['untimed_ms_per_round']:.2f}; " + "; ".join(
                      f"{key} x{c['count']} {c['mean_ms']:.2f} ms"
                      for key, c in r["calls"].items()))
            gp.write_part(plan, "diag-rounds", result)
        del pair


# ----------------------------------------------------------------------------- exact


def phase_exact(plan: gp.Plan) -> None:
    import numpy as np

    from specedge.runtime.kvcache import KVCache
    from specedge.runtime.pair import Pair

    info = reference(plan)
    if not need(plan, info, "exact"):
        return
    result: dict[str, Any] = {"pair": str(info.folder), "probe": {}}
    pair = Pair.load(info.folder, providers=plan.provider, verify_hashes=False,
                     two_row_steps=False)
    target = pair.target
    vocab = target.spec.vocab_size
    for past in (4, 16, 32, 64, 128):
        length = past + 3
        if length > target.spec.max_seq_len:
            break
        ids = (np.arange(length, dtype=np.int64) * 7919 + 11) % vocab

        def last(split: int, _ids: Any = ids, _length: int = length) -> Any:
            cache = KVCache(target, 1, max(_length, target.spec.min_cache_len), fixed=False)
            target.forward(cache, _ids[None, :split])
            return target.forward(cache, _ids[None, split:])[0, -1].astype(np.float64)

        alone, two, three = last(length - 1), last(length - 2), last(length - 3)
        result["probe"][str(past)] = {"single": float(np.abs(alone - two).max()),
                                      "block": float(np.abs(two - three).max()),
                                      "scale": float(np.abs(two).max())}
    print(f"exact: probe {json.dumps(result['probe'])}")
    gp.write_part(plan, "diag-exact", result)
    ids = gp.prompt_ids(info, plan.check_prompts)
    reference_out: list[list[int]] = []
    for two_rows in (False, True):
        if plan.left() < 15:
            break
        p = pair if not two_rows else Pair.load(info.folder, providers=plan.provider,
                                                verify_hashes=False, two_row_steps=True)
        equal = same_as_one_row = done = 0
        firsts: list[int] = []
        for i, prompt in enumerate(ids):
            if plan.left() < 6:
                break
            ref = p.generate_ids(prompt, greedy(plan.check_new, None))[0]
            out = p.generate_ids(prompt, greedy(plan.check_new, 3))[0]
            if not two_rows:
                reference_out.append(ref)
            elif i < len(reference_out):
                same_as_one_row += ref == reference_out[i]
            equal += out == ref
            if out != ref:
                firsts.append(next((j for j, (a, b) in enumerate(zip(out, ref, strict=False))
                                    if a != b), min(len(out), len(ref))))
            done += 1
        key = "two-row steps" if two_rows else "one-row steps"
        result[key] = {"K=3 == target-only": equal, "prompts": done,
                       "first_differences": firsts}
        if two_rows:
            result[key]["target-only == one-row target-only"] = same_as_one_row
        print(f"exact: {key}: {json.dumps(result[key])}")
        gp.write_part(plan, "diag-exact", result)


# ----------------------------------------------------------------------------- tf32


def phase_tf32(plan: gp.Plan) -> None:
    info = concat_reference(plan)
    if not need(plan, info, "tf32"):
        return
    batch = 8 if not plan.smoke else 4
    ids = gp.prompt_ids(info, batch)
    new = plan.batch_new
    result: dict[str, Any] = {"pair": str(info.folder), "batch": batch}
    for label, tf32 in (("tf32 off", False), ("tf32 on", True)):
        if plan.left() < 15:
            break
        try:
            pair = gp.load_variant(info.folder, plan, {"device_kv": True, "tf32": tf32})
        except Exception as exc:  # e.g. an onnxruntime that does not take the option
            result[label] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            continue
        alone = [pair.generate_ids(p, greedy(new, None))[0] for p in ids]
        row: dict[str, Any] = {}
        for klabel, cfg in (("target-only", greedy(new, None)), ("K=2", greedy(new, 2)),
                            ("K=4", greedy(new, 4)), ("adaptive", greedy(new, 4, True))):
            gpu_batch.run_batch(pair, ids[:2], cfg)  # warm-up
            outs, st = gpu_batch.run_batch(pair, ids, cfg)
            row[klabel] = {"equal_to_batch1": sum(o == a for o, a in zip(outs, alone,
                                                                         strict=True)),
                           "tokens_per_s": st.tokens_per_s}
        result[label] = row
        print(f"tf32: {label}: {json.dumps(row)}")
        gp.write_part(plan, "diag-tf32", result)
        del pair


# ----------------------------------------------------------------------------- nan


def phase_nan(plan: gp.Plan) -> None:
    import numpy as np

    from specedge.runtime.backend import _host
    from specedge.runtime.pair import Pair

    info = random_pair(plan)
    if not need(plan, info, "nan"):
        return
    result: dict[str, Any] = {"pair": str(info.folder)}
    pair = Pair.load(info.folder, providers=plan.provider, verify_hashes=False)
    prompt = gp.prompt_ids(info, 1)[0][:16]
    for name, model in (("target", pair.target), ("draft", pair.draft)):
        if model is None:
            continue
        cache = model.new_cache(1, 64)
        found = {}
        for what, tokens in (("prefill", prompt), ("step", prompt[-1:])):
            raw, skip = model._step(cache, np.asarray([tokens], np.int64))
            logits = np.asarray(_host(raw), dtype=np.float32)[0, skip:]
            finite = np.isfinite(logits)
            found[what] = {
                "positions": int(logits.shape[0]),
                "nan": [int(x) for x in np.isnan(logits).sum(-1)],
                "posinf": [int(x) for x in np.isposinf(logits).sum(-1)],
                "neginf": [int(x) for x in np.isneginf(logits).sum(-1)],
                "max_abs_finite": float(np.abs(np.where(finite, logits, 0)).max())}
        result[name] = found
    runs = {}
    for label, cfg in (("target-only", greedy(16, None)), ("K=2", greedy(16, 2))):
        try:
            pair.generate_ids(prompt, cfg)
            runs[label] = "ran"
        except Exception as exc:  # the point of the phase: say which and why
            runs[label] = f"{type(exc).__name__}: {str(exc)[:200]}"
    result["generations"] = runs
    gp.write_part(plan, "diag-nan", result)
    print(f"nan: {json.dumps(result)[:1500]}")


# ----------------------------------------------------------------------------- report


def report(plan: gp.Plan) -> None:
    """OUT/gpu_diag.json (every part) and OUT/gpu_diag.md (the same, readable)."""
    parts = {p.stem.removeprefix("diag-"): json.loads(p.read_text())
             for p in sorted(plan.parts.glob("diag-*.json"))}
    stem = "gpu_diag_cpu_smoke" if plan.smoke else "gpu_diag"
    plan.out.mkdir(parents=True, exist_ok=True)
    (plan.out / f"{stem}.json").write_text(json.dumps(parts, indent=2) + "\n")
    lines = [f"# GPU diagnostics{' (CPU smoke: not GPU figures)' if plan.smoke else ''}", "",
             f"Written by `scripts/gpu_check.sh --diag` on "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; raw data in {stem}.json. "
             "What each phase measures: `benchmarks/gpu_diag.py`.", ""]
    for name, data in parts.items():
        lines += [f"## {name}", "", "```", json.dumps(data, indent=1)[:12000], "```", ""]
    (plan.out / f"{stem}.md").write_text("\n".join(lines))
    print(f"report: {plan.out / stem}.md")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("phase", choices=("profile", "rounds", "exact", "tf32", "nan", "report"))
    ap.add_argument("--work", type=Path, default=Path("/tmp/specedge-gpu"))
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results")
    ap.add_argument("--cpu-smoke", action="store_true")
    ap.add_argument("--deadline", type=float, default=None, help="epoch seconds")
    args = ap.parse_args(argv)
    logging.disable(logging.WARNING)
    plan = gp.make_plan(args)
    phases = {"profile": phase_profile, "rounds": phase_rounds, "exact": phase_exact,
              "tf32": phase_tf32, "nan": phase_nan, "report": report}
    phases[args.phase](plan)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
