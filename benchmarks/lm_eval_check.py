"""lm-evaluation-harness against `specedge serve`: a multiple-choice task scored through the
server's completions API (token-id prompts, `echo`, `logprobs`; the harness tokenizes through the
server's /tokenize), and the same task scored by the harness's own transformers backend on the
same weights, per sample.

    python benchmarks/lm_eval_check.py pairs/smollm2-135m --gguf PATH/TO/smollm2.gguf

Needs `lm_eval` (and, for the reference, torch, transformers and gguf) in the Python that runs
it; `specedge` runs from this checkout's `.venv-runtime` (or `--specedge`). The task is a small
set of general-knowledge questions written below (no dataset download). Prints both accuracies,
the largest per-choice loglikelihood difference, and how many greedy flags agree.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

QUESTIONS = [
    ("The capital of France is", ["Paris", "London", "Berlin", "Madrid"], 0),
    ("The largest planet in the solar system is", ["Mars", "Jupiter", "Venus", "Mercury"], 1),
    ("Water freezes at a temperature of", ["100 degrees Celsius", "50 degrees Celsius",
                                           "0 degrees Celsius", "20 degrees Celsius"], 2),
    ("The chemical symbol for gold is", ["Ag", "Fe", "Cu", "Au"], 3),
    ("The number of days in a week is", ["seven", "five", "ten", "twelve"], 0),
    ("The opposite of hot is", ["warm", "cold", "loud", "fast"], 1),
    ("A baby cat is called a", ["puppy", "calf", "kitten", "foal"], 2),
    ("The color of a clear daytime sky is", ["green", "red", "purple", "blue"], 3),
    ("The author of Romeo and Juliet is", ["William Shakespeare", "Charles Dickens",
                                           "Jane Austen", "Mark Twain"], 0),
    ("Two plus two equals", ["three", "four", "five", "six"], 1),
    ("The longest river in Africa is the", ["Amazon", "Danube", "Nile", "Thames"], 2),
    ("Bees make", ["milk", "silk", "wool", "honey"], 3),
    ("The Earth orbits the", ["Sun", "Moon", "Mars", "comet"], 0),
    ("The language mostly spoken in Brazil is", ["Spanish", "Portuguese", "French", "Italian"],
     1),
    ("Ice is the solid form of", ["air", "sand", "water", "oil"], 2),
    ("The first letter of the English alphabet is", ["Z", "M", "Q", "A"], 3),
    ("A triangle has", ["three sides", "four sides", "five sides", "six sides"], 0),
    ("The freezing point of water in Fahrenheit is", ["0 degrees", "32 degrees",
                                                      "100 degrees", "212 degrees"], 1),
    ("The animal known as the king of the jungle is the", ["elephant", "zebra", "lion",
                                                           "giraffe"], 2),
    ("Python is a programming", ["game", "river", "planet", "language"], 3),
]

TASK = """task: specedge_facts
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_lm_eval(args: list[str], out: Path, batch: int = 1
                 ) -> dict[tuple[int, int], tuple[float, bool]]:
    """Run lm_eval; returns (doc, choice) -> (loglikelihood, is_greedy) from its samples."""
    subprocess.run([sys.executable, "-m", "lm_eval", *args, "--output_path", str(out),
                    "--log_samples", "--batch_size", str(batch)], check=True)
    samples = next(out.rglob("samples_specedge_facts_*.jsonl"))
    scores = {}
    for line in samples.read_text().splitlines():
        doc = json.loads(line)
        for j, resp in enumerate(doc["resps"]):
            loglik, greedy = resp[0]
            scores[(doc["doc_id"], j)] = (float(loglik), bool(greedy))
    return scores


def _accuracy(scores: dict[tuple[int, int], tuple[float, bool]]) -> float:
    right = 0
    for i, (_, choices, answer) in enumerate(QUESTIONS):
        best = max(range(len(choices)), key=lambda j: scores[(i, j)][0])
        right += best == answer
    return right / len(QUESTIONS)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pair", type=Path)
    ap.add_argument("--gguf", type=Path, default=None, help="the same weights for the "
                    "transformers reference (skipped without)")
    ap.add_argument("--specedge", default=str(Path(".venv-runtime/bin/specedge")))
    ap.add_argument("--batch-size", type=int, default=1, help="prompts per request (the "
                    "harness's --batch_size; on a --graph concat pair they decode together)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="lm-eval-check-"))
    data = work / "facts.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n"
                            for q, c, a in QUESTIONS))
    (work / "task.yaml").write_text(TASK.format(data=data))
    port = _free_port()
    server = subprocess.Popen([args.specedge, "serve", str(args.pair), "--port", str(port),
                               "--model-name", "pair"], env=dict(os.environ))
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise SystemExit("specedge serve did not start") from None
                time.sleep(0.5)
        started = time.monotonic()
        served = _run_lm_eval(
            ["--model", "local-completions", "--model_args",
             # no tokenizer given: the harness finds the server's /tokenizer_info and
             # /tokenize and uses its "remote" tokenizer
             f"model=pair,base_url=http://127.0.0.1:{port}/v1/completions,"
             "num_concurrent=1,max_retries=1",
             "--tasks", "specedge_facts", "--include_path", str(work)], work / "served",
            args.batch_size)
        seconds = time.monotonic() - started
    finally:
        server.terminate()
        server.wait(30)
    print(f"lm-evaluation-harness, {len(QUESTIONS)} four-choice questions, loglikelihood")
    print(f"specedge serve ({args.pair}, {args.batch_size} prompts per request): acc "
          f"{_accuracy(served):.3f} in {seconds:.1f} s (harness start-up included)")
    if args.gguf is None:
        return
    reference = _run_lm_eval(
        ["--model", "hf", "--model_args",
         f"pretrained={args.gguf.parent},gguf_file={args.gguf.name},"
         f"tokenizer={args.pair.resolve()},dtype=float32", "--device", "cpu",
         "--tasks", "specedge_facts", "--include_path", str(work)], work / "reference")
    delta = max(abs(served[k][0] - reference[k][0]) for k in served)
    greedy = sum(served[k][1] == reference[k][1] for k in served)
    print(f"transformers on the GGUF ({args.gguf.name}, float32): acc "
          f"{_accuracy(reference):.3f}")
    print(f"per choice: max |loglikelihood difference| {delta:.2e}; greedy flags equal "
          f"{greedy}/{len(served)}")


if __name__ == "__main__":
    main()
