"""Bounded load on `specedge serve`, speculation on vs off (issue 14).

Usage: python benchmarks/serve_load.py [PAIR] [--requests 200] [--clients 8] [--max-tokens 32]
           [--solo 8] [--modes spec,plain] [--repeat N] [--distinct N] [--json OUT.json]

For each mode a fresh server (`python -m specedge.serve_cli PAIR`, with `--no-speculation` for
"plain") is started on 127.0.0.1. After a warm-up (each distinct prompt of the load once, at the
load's concurrency) it answers `--solo` requests from one client
(batch-1 latency), then `--requests` streaming chat requests from `--clients` concurrent
clients (greedy, prompts from benchmarks/prompts.jsonl, so both modes do the same work and must
give the same text). Reported per mode: time to first token and per-token latency (p50/p95),
aggregate completion tokens per second, status codes, lost or duplicated responses (checked on
the client: one 200 and one [DONE] per request, unique ids; and on the server's /metrics), and
the server's RSS after the warm-up and after the load. A benchmark, not a test: it prints.

`--repeat N` runs the modes N times, the order reversed every other time (spec, plain, plain,
spec, ...), and reports each run and the ratio of the modes' medians: the server started first
in a run read 15-20% slower whichever mode it was (one run each way, 2 cores), so one
spec-then-plain run is biased against speculation.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from statistics import median
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Record:
    index: int
    status: int = 0
    id: str = ""
    text: str = ""
    tokens: int = 0
    ttft_s: float = float("nan")
    per_token_s: float = float("nan")
    done_markers: int = 0
    error: str = ""


@dataclass
class ModeResult:
    mode: str
    solo: list[Record] = field(default_factory=list)
    load: list[Record] = field(default_factory=list)
    load_s: float = 0.0
    rss_before_mb: float = 0.0
    rss_after_mb: float = 0.0
    server_ok: float = 0.0  # 200s the server counted during the load
    server_generations: float = 0.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def pct(values: list[float], q: float) -> float:
    vals = sorted(v for v in values if v == v)
    if not vals:
        return float("nan")
    pos = (len(vals) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(vals) - 1)
    return vals[lo] + (vals[hi] - vals[lo]) * (pos - lo)


def metric_sum(text: str, prefix: str) -> float:
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(prefix))


async def one(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int,
              index: int) -> Record:
    rec = Record(index)
    body = {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first = last = None
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            rec.status = response.status_code
            if response.status_code != 200:
                rec.error = (await response.aread()).decode()[:200]
                return rec
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    rec.done_markers += 1
                    continue
                chunk = json.loads(line[6:])
                rec.id = rec.id or chunk.get("id", "")
                if chunk.get("usage"):
                    rec.tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices", []):
                    if text := choice["delta"].get("content"):
                        now = time.perf_counter()
                        first = first or now
                        last = now
                        rec.text += text
    except httpx.HTTPError as exc:
        rec.error = type(exc).__name__
    if first is not None and last is not None:
        rec.ttft_s = first - start
        if rec.tokens > 1:
            rec.per_token_s = (last - first) / (rec.tokens - 1)
    return rec


async def drive(url: str, model: str, prompts: list[str], n: int, clients: int,
                max_tokens: int) -> tuple[list[Record], float]:
    """`n` requests from `clients` concurrent clients; returns the records and the wall time."""
    todo = iter(range(n))
    records: list[Record] = []

    async def worker(client: httpx.AsyncClient) -> None:
        for i in todo:
            records.append(await one(client, model, prompts[i % len(prompts)], max_tokens, i))
            if n >= 20 and len(records) % (n // 10) == 0:
                print(f"  {len(records)}/{n} answered", flush=True)

    limits = httpx.Limits(max_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(clients)))
        return records, time.perf_counter() - start


def start_server(pair: Path, mode: str, port: int, queue: int) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "specedge.serve_cli", str(pair), "--port", str(port),
           "--max-queue", str(queue), "--log-level", "warning"]
    if mode == "plain":
        cmd.append("--no-speculation")
    proc = subprocess.Popen(cmd, cwd=ROOT)
    deadline = time.monotonic() + 120
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the {mode} server did not start")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).is_success:
                return proc
        except httpx.TransportError:
            time.sleep(0.2)


def run_mode(mode: str, args: argparse.Namespace, prompts: list[str]) -> ModeResult:
    port = free_port()
    proc = start_server(args.pair, mode, port, max(16, args.clients * 2))
    url = f"http://127.0.0.1:{port}"
    model = args.model or args.pair.name
    result = ModeResult(mode)
    try:
        # Warm-up: every prompt of the load once, so the RSS before the load already holds
        # the buffers its longest prompts need (growth then means a leak, not a high-water mark).
        asyncio.run(drive(url, model, prompts, min(args.requests, len(prompts)), args.clients,
                          args.max_tokens))
        result.solo, _ = asyncio.run(drive(url, model, prompts, args.solo, 1, args.max_tokens))
        result.rss_before_mb = rss_mb(proc.pid)
        before = httpx.get(url + "/metrics").text
        result.load, result.load_s = asyncio.run(drive(url, model, prompts, args.requests,
                                                       args.clients, args.max_tokens))
        after = httpx.get(url + "/metrics").text
        result.rss_after_mb = rss_mb(proc.pid)
        ok = 'specedge_requests_total{route="/v1/chat/completions",status="200"}'
        result.server_ok = metric_sum(after, ok) - metric_sum(before, ok)
        gen = "specedge_generations_total"
        result.server_generations = metric_sum(after, gen) - metric_sum(before, gen)
    finally:
        proc.terminate()
        proc.wait(30)
    return result


def summary(r: ModeResult, requests: int) -> dict[str, Any]:
    load = r.load
    ids = [x.id for x in load if x.id]
    tokens = sum(x.tokens for x in load)
    answered = [x for x in load if x.status == 200 and x.done_markers == 1 and x.id]
    return {
        "mode": r.mode, "requests": requests, "answered": len(answered),
        "lost": requests - len({x.index for x in answered}),
        "duplicated": (len(ids) - len(set(ids))) + sum(x.done_markers > 1 for x in load),
        "server_counted_200": int(r.server_ok),
        "server_counted_generations": int(r.server_generations),
        "status_5xx": sum(x.status >= 500 for x in load),
        "status_4xx": sum(400 <= x.status < 500 for x in load),
        "errors": sorted({x.error for x in load if x.error})[:3],
        "ttft_p50_ms": 1000 * pct([x.ttft_s for x in load], 0.5),
        "ttft_p95_ms": 1000 * pct([x.ttft_s for x in load], 0.95),
        "per_token_p50_ms": 1000 * pct([x.per_token_s for x in load], 0.5),
        "per_token_p95_ms": 1000 * pct([x.per_token_s for x in load], 0.95),
        "completion_tokens": tokens, "load_s": r.load_s,
        "aggregate_tok_s": tokens / r.load_s if r.load_s else 0.0,
        "solo_ttft_p50_ms": 1000 * pct([x.ttft_s for x in r.solo], 0.5),
        "solo_per_token_p50_ms": 1000 * pct([x.per_token_s for x in r.solo], 0.5),
        "rss_before_mb": r.rss_before_mb, "rss_after_mb": r.rss_after_mb,
        "rss_growth_mb": r.rss_after_mb - r.rss_before_mb,
    }


def print_table(rows: list[dict[str, Any]]) -> None:
    keys = [k for k in rows[0] if k not in ("mode", "errors")]
    print(f"{'':28}" + "".join(f"{r['mode']:>14}" for r in rows))
    for key in keys:
        cells = []
        for r in rows:
            v = r[key]
            cells.append(f"{v:>14.1f}" if isinstance(v, float) else f"{v!s:>14}")
        print(f"{key:28}" + "".join(cells))
    for r in rows:
        if r["errors"]:
            print(f"{r['mode']} errors: {r['errors']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("pair", type=Path, nargs="?", default=ROOT / "pairs" / "smollm2-135m")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--solo", type=int, default=8, help="Sequential requests (batch-1 latency).")
    ap.add_argument("--modes", default="spec,plain")
    ap.add_argument("--repeat", type=int, default=1,
                    help="Run the modes N times, the order reversed every other time.")
    ap.add_argument("--model", default=None, help="Model id (default: the pair folder's name).")
    ap.add_argument("--prompts", type=Path, default=ROOT / "benchmarks" / "prompts.jsonl")
    ap.add_argument("--distinct", type=int, default=0,
                    help="Use only the first N prompts (0: all); the warm-up runs each once.")
    ap.add_argument("--json", dest="json_out", type=Path, default=None)
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the servers are stopped
    prompts = [json.loads(line)["prompt"] for line in args.prompts.read_text().splitlines()
               if line.strip()][:args.distinct or None]
    modes = args.modes.split(",")
    results = []
    for turn in range(max(1, args.repeat)):
        for mode in modes if turn % 2 == 0 else modes[::-1]:
            print(f"running {mode}: {args.requests} requests from {args.clients} clients, "
                  f"{args.max_tokens} max tokens ...", flush=True)
            results.append(run_mode(mode, args, prompts))
    rows = [summary(r, args.requests) for r in results]
    if args.repeat > 1:
        for i, row in enumerate(rows):
            row["mode"] = f"{row['mode']}#{i // len(modes) + 1}"
    print_table(rows)
    if len(modes) == 2:
        a, b = modes
        texts = [{x.index: x.text for x in r.load} for r in results]
        same = all(t.get(i) == texts[0].get(i) for t in texts for i in range(args.requests))
        agg = {m: median(r["aggregate_tok_s"] for r, x in zip(rows, results, strict=True)
                         if x.mode == m) for m in modes}
        solo = {m: median(r["solo_per_token_p50_ms"] for r, x in zip(rows, results, strict=True)
                          if x.mode == m) for m in modes}
        runs = f" (medians of {args.repeat} runs each)" if args.repeat > 1 else ""
        print(f"aggregate tok/s {a}/{b}: {agg[a] / agg[b]:.2f}x; batch-1 per-token latency "
              f"{a} {solo[a]:.1f} ms vs {b} {solo[b]:.1f} ms{runs}; identical text in every "
              f"run: {'yes' if same else 'NO'} ({args.requests} requests)")
    if args.json_out:
        args.json_out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                             "summary": rows,
                                             "records": {row["mode"]: [asdict(x) for x in r.load]
                                                         for row, r in zip(rows, results,
                                                                           strict=True)}},
                                            indent=1))


if __name__ == "__main__":
    main()
