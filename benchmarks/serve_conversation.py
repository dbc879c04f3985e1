"""Multi-turn chat against `specedge serve`, with and without its prefix cache.

    python benchmarks/serve_conversation.py pairs/smollm2-135m-fast --turns 8 --conversations 2

Two servers run the same pair: `--prefix-cache 1` (the default) and `--prefix-cache 0`. A
client holds one conversation per server and sends each turn to both, re-sending the whole
history as chat clients do (streaming, greedy, `stream_options.include_usage`); it pauses
`--think` seconds after each reply (a user reading, when the caching server prefills the
conversation ahead), so the two servers never decode at the same time. Reported per turn: the
prompt's tokens, the tokens the cache held (`usage.prompt_tokens_details.cached_tokens`) and the
time to the first streamed text of each server, medians over the conversations. Replies must be
identical. Writes markdown with --out.

With `--concurrent` the conversations run side by side: each turn of every conversation goes
to a server at once (a batching server, `--graph concat` pairs, decodes them as rows of one
batch; each keeps its prefix in its own slot), then to the other server.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
SYSTEM = ("You are a helpful assistant running on a small device. Answer clearly and "
          "concisely, use lists where they help, and ask a question when a request is unclear.")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start(pair: str, cache: int) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    specedge = Path(sys.executable).parent / "specedge"  # the CLI, as users start it
    proc = subprocess.Popen([str(specedge), "serve", pair, "--port", str(port), "--prefix-cache",
                             str(cache), "--log-level", "warning"], cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"the server with --prefix-cache {cache} did not start")


def turn(url: str, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    """One streamed chat request: the reply, the time to its first text, and its usage."""
    model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first: float | None = None
    text: list[str] = []
    usage: dict[str, Any] = {}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
        if r.status_code != 200:
            raise SystemExit(f"{url}: {r.status_code} {r.read().decode()[:300]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices", []):
                piece = choice.get("delta", {}).get("content")
                if piece:
                    first = first or time.perf_counter() - t0
                    text.append(piece)
    return {"text": "".join(text), "ttft": first or time.perf_counter() - t0,
            "total": time.perf_counter() - t0, "prompt": usage.get("prompt_tokens", 0),
            "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pair")
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--conversations", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--think", type=float, default=1.0, help="seconds between turns")
    ap.add_argument("--concurrent", action="store_true",
                    help="send every conversation's turn at once (a batch)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    questions = [json.loads(line)["prompt"] for line in
                 (ROOT / "benchmarks" / "prompts.jsonl").read_text().splitlines() if line]
    servers = {cache: start(args.pair, cache) for cache in (1, 0)}
    rows: dict[int, dict[str, list[float]]] = {}
    same = total = 0
    began = time.perf_counter()
    # Conversations in groups that run at once: all together with --concurrent, else one by one.
    n = args.conversations
    groups = [list(range(n))] if args.concurrent else [[c] for c in range(n)]
    pool = ThreadPoolExecutor(max(1, n))
    try:
        for group in groups:
            chats = {c: [{"role": "system", "content": SYSTEM}] for c in group}
            for t in range(args.turns):
                for c in group:
                    chats[c].append({"role": "user",
                                     "content": questions[(c * args.turns + t) % len(questions)]})
                replies: dict[int, list[dict[str, Any]]] = {}
                for cache, (_, url) in servers.items():
                    replies[cache] = list(pool.map(
                        lambda c, url=url, chats=chats: turn(url, chats[c], args.max_tokens),
                        group))
                    time.sleep(args.think)  # a user reading; the caching server prefills ahead
                row = rows.setdefault(t, {})
                for i, c in enumerate(group):
                    for cache in servers:
                        row.setdefault(f"ttft{cache}", []).append(replies[cache][i]["ttft"])
                    row.setdefault("prompt", []).append(replies[0][i]["prompt"])
                    row.setdefault("cached", []).append(replies[1][i]["cached"])
                    total += 1
                    same += replies[0][i]["text"] == replies[1][i]["text"]
                    chats[c].append({"role": "assistant", "content": replies[0][i]["text"]})
    finally:
        pool.shutdown()
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(20)
    elapsed = time.perf_counter() - began
    med = statistics.median
    lines = ["| turn | prompt tokens | cached (usage) | first text, no cache (ms) | "
             "first text, cache (ms) | × |", "|---|---|---|---|---|---|"]
    for t, r in sorted(rows.items()):
        lines.append(f"| {t + 1} | {med(r['prompt']):.0f} | {med(r['cached']):.0f} | "
                     f"{med(r['ttft0']) * 1e3:.0f} | {med(r['ttft1']) * 1e3:.0f} | "
                     f"{med(r['ttft0']) / med(r['ttft1']):.2f} |")
    sums = [sum(x for r in rows.values() for x in r[f"ttft{k}"]) for k in (0, 1)]
    text = "\n".join([
        f"Run {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {elapsed / 60:.1f} min, "
        f"`python benchmarks/serve_conversation.py {args.pair} --turns {args.turns} "
        f"--conversations {args.conversations} --max-tokens {args.max_tokens} --think "
        f"{args.think:g}{' --concurrent' if args.concurrent else ''}`.",
        f"Machine: {platform.machine()}, Python {platform.python_version()}; two `specedge "
        "serve` processes (`--prefix-cache 1` and `0`), a streaming client re-sending each "
        f"conversation{' (all conversations at once)' if args.concurrent else ''}; greedy; "
        f"median over {args.conversations} conversations.",
        "", *lines, "",
        f"- Replies identical with and without the cache: {same}/{total}.",
        f"- Time to first text over all turns: {sums[0]:.2f} s without, {sums[1]:.2f} s with "
        f"the cache ({sums[0] / sums[1]:.2f}x).",
    ])
    print(text)
    if args.out:
        Path(args.out).write_text(f"# Prefix caching in `specedge serve`: multi-turn chat\n\n"
                                  f"{text}\n")
    if same != total:
        raise SystemExit("replies differ with the prefix cache")


if __name__ == "__main__":
    main()
