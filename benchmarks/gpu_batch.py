"""The GPU check's `batch` phase (`benchmarks/gpu_check.py`, issue 19): batched decoding on the
concat-form reference pair, B = 1..32: aggregate tok/s of batched target-only, fixed K and
adaptive K, greedy rows == their batch-1 runs, verify(B x (K+1)) / verify(B x 1) per B; then the
7B-shaped pair's costs and its speed-ups predicted from them and the reference acceptance."""

from __future__ import annotations

import json
import time
from typing import Any

from gpu_plan import (
    PairInfo,
    Plan,
    graphed_draft,
    graphed_pair,
    guarded,
    load_variant,
    prompt_ids,
    wait_for,
    write_part,
)


def batch_pairs(plan: Plan) -> list[PairInfo]:
    """The concat-form pairs batched decoding runs on."""
    pairs = plan.work / "pairs"
    if plan.smoke:
        return [PairInfo("reference", pairs / "tiny-mixed", None, None, None, "tiny", True),
                PairInfo("tiny", pairs / "tiny-concat", None, None, None, "tiny", False)]
    return [PairInfo("reference", pairs / "ref-concat", None, None, None, "smollm2-135m", True),
            PairInfo("qwen2.5-7b", pairs / "qwen2.5-7b-concat", None, None, None,
                     "qwen2.5-7b", False)]


def phase_batch(plan: Plan) -> None:
    infos = batch_pairs(plan)
    for n, info in enumerate(infos):
        name = f"batch-{info.name}"
        if not wait_for(info.folder, plan, reserve=20):
            write_part(plan, name, {"error": f"{info.folder} was not built"})
            continue
        # The reference pair's sweep (generation, acceptance) leaves the shaped pair (costs and
        # target-only, quick, but a 15 GB target to load) 40% of the phase.
        until = plan.deadline - (0.4 * plan.left() if n < len(infos) - 1 else 0.0)
        try:
            batch_sweep(plan, info, name, until)
        except Exception as exc:  # the report says why
            write_part(plan, name, {"error": f"{type(exc).__name__}: {str(exc)[:300]}"})
            print(f"batch {info.name}: {type(exc).__name__}: {exc}")


def run_batch(pair: Any, prompts: list[list[int]], cfg: Any) -> tuple[list[list[int]], Any]:
    """One batch of token-id prompts (greedy); the rows' new tokens and the batch totals.
    Adaptive K keeps its tuners on the pair, as `specedge bench --batch` and a user's
    `generate_batch` do: a batch size's first batch starts from the nearest size's."""
    result = pair.generate_batch_ids(prompts, cfg)
    return [r.tokens for r in result.results], result.stats


def batch_sweep(plan: Plan, info: PairInfo, name: str, until: float) -> None:
    """Aggregate tok/s of batched target-only, fixed K and adaptive K at each B (interleaved on
    the same batch), greedy rows against batch-1 target-only, and verify(B x (K+1)) /
    verify(B x 1)."""
    from specedge.runtime.batch_bench import (
        measure_batch_costs,
        time_host_greedy,
        time_rows_call,
    )
    from specedge.runtime.pair import GenerationConfig

    # The KV cache on the device (the GPU default); the CPU smoke runs that same code path.
    pair = load_variant(info.folder, plan, {"device_kv": True})
    result: dict[str, Any] = {"pair": str(info.folder), "provider": plan.provider,
                              "graph": pair.manifest.target.graph, "new_tokens": plan.batch_new,
                              "ks": list(plan.batch_ks), "rows": {}, "notes": [],
                              "device_kv": pair.target.config.kv_on_device}
    ids = prompt_ids(info, max(plan.batches))
    new = plan.batch_new
    target_only = GenerationConfig(max_new_tokens=new, drafter="none")
    settings = {"target-only": target_only}
    # Random weights make acceptance meaningless: such a pair gives its costs (the report
    # predicts its speed-ups with the reference pair's acceptance) and batched target-only.
    result["real_weights"] = info.real_weights
    if pair.draft is not None and info.real_weights:
        settings.update({f"K={k}": GenerationConfig(max_new_tokens=new, drafter="model",
                                                   num_draft_tokens=k, adaptive=False)
                         for k in plan.batch_ks})
        settings["adaptive"] = GenerationConfig(max_new_tokens=new, drafter="model",
                                                num_draft_tokens=max(plan.batch_ks),
                                                adaptive=True)
    run_batch(pair, ids[:2], settings[list(settings)[-1]])  # warm-up
    # The draft replaying CUDA graphs has not run in batches on a GPU yet: whatever it raises
    # costs only its own figures, noted, never the sweep's.
    graphed = None if info.real_weights else guarded(
        result, "the draft on CUDA graphs", graphed_draft, plan, pair)
    # A real pair whose draft is in place also decodes with that draft replaying CUDA graphs
    # (fixed buffers on the CPU smoke): measured, not predicted.
    runs = {label: pair for label in settings}
    replaying = guarded(result, "the pair with its draft on CUDA graphs", graphed_pair, plan,
                        info) if info.real_weights else None
    if replaying is not None:
        k = min(plan.batch_ks)
        label = f"K={k}, draft graphs"
        if guarded(result, f"{label} (warm-up)", run_batch, replaying, ids[:2],  # captures
                   settings[f"K={k}"]) is not None:
            settings[label] = settings[f"K={k}"]
            runs[label] = replaying
    alone: list[list[int]] = []  # batch-1 target-only outputs, the exactness reference
    outputs: dict[tuple[int, str], list[list[int]]] = {}
    # A shaped pair is there for the bar at B=8: that first.
    order = plan.batches if info.real_weights else sorted(plan.batches, key=lambda b: b != 8)
    for batch in order:
        if until - time.time() < (20 if not plan.smoke else 5):
            result["notes"].append(f"stopped before B={batch} (time)")
            break
        while len(alone) < batch:
            alone.append(pair.generate_ids(ids[len(alone)], target_only)[0])
        row: dict[str, Any] = {}
        for label, cfg in list(settings.items()):
            if runs[label] is pair:
                outs, st = run_batch(pair, ids[:batch], cfg)
            else:
                done = guarded(result, f"{label} at B={batch}", run_batch, runs[label],
                               ids[:batch], cfg)
                if done is None:
                    del settings[label]
                    continue
                outs, st = done
            outputs[(batch, label)] = outs
            row[label] = {"tokens_per_s": st.tokens_per_s, "acceptance": st.acceptance_rate,
                          "rounds": st.rounds, "new_tokens": st.new_tokens,
                          "host_ms_per_round": 1000 * max(0.0, st.decode_s - st.draft_s
                                                          - st.verify_s) / max(1, st.rounds),
                          "equal_to_batch1": sum(o == a for o, a in zip(outs, alone,
                                                                        strict=False))}
        costs = measure_batch_costs(pair, batch, plan.batch_ks, reps=3 if plan.smoke else 5)
        for s in sorted({1, *(k + 1 for k in plan.batch_ks)}):  # the host's greedy share
            costs[f"host_{s}"] = time_host_greedy(batch, s, pair.target.logits_size,
                                                  pair.target.spec.logits_dtype,
                                                  reps=3 if plan.smoke else 5)
        if graphed is not None:  # warm-up and capture runs first: reps to spare
            step = guarded(result, f"the draft step on CUDA graphs at B={batch}",
                           time_rows_call, graphed, batch, 1, pair.manifest.vocab_size,
                           reps=5 if plan.smoke else 9)
            if step is not None:
                costs["draft_step_graph"] = step
        row["costs"] = costs
        row["verify_ratio"] = {f"K={k}": costs[f"verify_{k + 1}"] / costs["verify_1"]
                               for k in plan.batch_ks if f"verify_{k + 1}" in costs}
        result["rows"][str(batch)] = row
        write_part(plan, name, result)
        base = row["target-only"]["tokens_per_s"]
        print(f"batch {info.name} B={batch}: " + ", ".join(
            f"{k} {v['tokens_per_s']:.0f} tok/s ({v['tokens_per_s'] / base:.2f}x)"
            for k, v in row.items() if isinstance(v, dict) and "tokens_per_s" in v))
    if info.real_weights and pair.draft is not None and until - time.time() > (
            15 if not plan.smoke else 3):
        result["slot_prefix"] = guarded(result, "the batch's kept prefixes", slot_prefix_check,
                                        pair, ids, new) or {"error": "failed (notes)"}
        print(f"batch {info.name}: kept prefixes {json.dumps(result['slot_prefix'])}")
    # What the device cache saves: B=8 (or the largest B run) with the cache on the host, the
    # whole valid cache crossing to the device and back every call.
    done = [int(b) for b in result["rows"]]
    if done and info.real_weights and until - time.time() > (25 if not plan.smoke else 5):
        batch = 8 if 8 in done else max(done)
        del pair
        host = load_variant(info.folder, plan, {"device_kv": False})
        result["host_kv"] = {"batch": batch}
        for label in ("target-only", "adaptive"):
            if label in settings:
                outs, st = run_batch(host, ids[:batch], settings[label])
                result["host_kv"][label] = {
                    "tokens_per_s": st.tokens_per_s,
                    "device_kv_speedup": result["rows"][str(batch)][label]["tokens_per_s"]
                    / st.tokens_per_s,
                    "equal_to_device_kv": outs == outputs[(batch, label)]}
        print(f"batch {info.name} B={batch}, KV cache on the host: {result['host_kv']}")
    write_part(plan, name, result)


def slot_prefix_check(pair: Any, ids: list[list[int]], new: int, turns: int = 4
                      ) -> dict[str, Any]:
    """Two chats at once in a continuous batch of two slots (each turn: the last prompt, its
    output, prefilled ahead into its slot, and a next message) that keeps prefixes in its free
    slots, against one that keeps none: the same tokens every turn (greedy, K=2), and the
    prompt tokens each request reused (`runtime/slot_prefix`); then three rows sharing a
    document in one batch (copied prefixes) against their batch-1 runs."""
    from specedge.runtime.pair import GenerationConfig
    from specedge.runtime.serving import ContinuousBatch

    config = GenerationConfig(max_new_tokens=new, drafter="model", num_draft_tokens=2,
                              adaptive=False)
    outputs: dict[bool, list[list[int]]] = {}
    reused: list[int] = []
    for keep in (True, False):
        server = ContinuousBatch(pair, capacity=2, keep_prefixes=keep, drafter="model",
                                 num_draft_tokens=2, adaptive=False)
        chats: list[list[int]] = [[], []]
        for i, chat in enumerate(chats):  # first prompts longer than a chunk: turn 2 reuses
            while len(chat) < 140:
                chat += ids[(i + len(chat)) % len(ids)]
        got: list[list[int]] = []
        for turn in range(turns):
            rids = [server.submit_ids(chat, config) for chat in chats]
            done = server.run()
            for i, rid in enumerate(rids):
                got.append(done[rid].tokens)
                history = chats[i] + done[rid].tokens
                if keep:
                    reused.append(done[rid].stats.cached_tokens)
                    server.prefill_ahead(history)
                chats[i] = history + ids[(2 + 2 * turn + i) % len(ids)][:24]
        outputs[keep] = got
    equal = sum(a == b for a, b in zip(outputs[True], outputs[False], strict=True))
    # A batch of rows that share one document: the later rows copy its chunks from the first
    # (`KVCache.copy_prefix`: the copy graph on the device); each row against its batch-1 run.
    doc: list[int] = []
    while len(doc) < 300:
        doc += ids[len(doc) % len(ids)]
    rows = [doc + ids[(i + 3) % len(ids)][:16] for i in range(3)]
    batch = pair.generate_batch_ids(rows, config)
    shared = [r.stats.cached_tokens for r in batch.results]
    equal += sum(r.tokens == pair.generate_ids(p, config)[0]
                 for r, p in zip(batch.results, rows, strict=True))
    return {"equal": equal, "generations": len(outputs[True]) + len(rows), "reused": reused,
            "shared": shared}
