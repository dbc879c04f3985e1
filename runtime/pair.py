"""The Python API: load a pair folder once, generate from many threads.

    pair = Pair.load("pairs/smollm2-135m")
    result = pair.generate("Write a haiku about the sea.", GenerationConfig(max_new_tokens=64))
    print(result.text, result.stats.tokens_per_s)
    for delta in pair.stream([{"role": "user", "content": "Hi"}]):
        print(delta, end="")

Thread-safety contract: a loaded `Pair` (its ONNX Runtime sessions, tokenizer and manifest) is
shared and read-only; every `generate`/`stream` call owns its KV caches (new ones, or kept ones
it takes from the prefix cache, which no other call can take meanwhile), random generator and
statistics, so several threads may generate at once.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Generator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .adaptive import AdaptiveK
from .backend import OrtModel
from .batch import RowRequest, decode_batch
from .drafters import build_drafter, draft_model_cache, self_draft
from .errors import InputError
from .generation import (
    BatchResult,
    GenerationConfig,
    GenerationResult,
    Prompt,
    as_config,
    row_configs,
)
from .grammar import GrammarCompiler, GrammarState
from .hugepages import HugePageLoad, HugePageReport
from .loading import ThreadPlan, load_model, plan_threads, session_plan
from .logprobs import TokenLogprob
from .manifest import PairManifest, load_manifest
from .policy import DRAFTER_CHOICES, MODEL_DRAFTERS, DecodePlan, resolve_plan
from .prefix_cache import (
    Entry,
    PrefixCache,
    cache_capacity,
    extend,
    kept_prefix,
    prompt_logprobs,
)
from .prompting import Prompts
from .rounds import RowOutput, RowSampler
from .rowprobe import probe_rows
from .speculative import decode
from .stats import GenerationStats
from .text import Tokenizer
from .tuner_store import TunerStore

__all__ = ["DRAFTER_CHOICES", "BatchResult", "GenerationConfig", "GenerationResult", "Pair",
           "Prompt", "ThreadPlan", "as_config", "load_model", "plan_threads"]
log = logging.getLogger(__name__)


def _timed(rounds: Generator[list[int], None, str], stats: GenerationStats, start: float
           ) -> Generator[list[int], None, str]:
    """`rounds`, setting `stats.total_s` (from `start`) when it ends or is closed."""
    try:
        return (yield from rounds)
    finally:
        stats.total_s = time.perf_counter() - start


class Pair:
    """A loaded pair folder: target (+ draft) sessions, tokenizer and manifest."""

    def __init__(self, manifest: PairManifest, tokenizer: Tokenizer, target: OrtModel,
                 draft: OrtModel | None, prefix_cache: int = 0) -> None:
        self.manifest, self.tokenizer, self.target, self.draft = (manifest, tokenizer, target,
                                                                  draft)
        # The caches of finished batch-1 generations, for prompts that start alike (see
        # `runtime/prefix_cache`; size 0 keeps none).
        self.prefixes = PrefixCache(prefix_cache)
        # Adaptive-K state learned by generations, per (batch size, drafter, k max).
        self.tuners = TunerStore()
        self.grammars = GrammarCompiler(tokenizer.to_json, target.spec.vocab_size,
                                        manifest.eos_token_ids)
        # A self-draft takes the prompt's keys and values from the target's prefill instead
        # of prefilling it again (`drafters.self_draft`; set False to prefill it).
        self.shares_prompt_kv = draft is not None and self_draft(target.spec, draft.spec)
        # Prompts as ids; the reply's grammar after a reasoning model's thinking.
        self.prompts = Prompts.of(tokenizer, manifest.vocab_size)
        # Why a listed TensorRT engine was not used, per model (empty when none was skipped).
        self.engine_notes: dict[str, str] = {}
        # What loading did about huge pages for the weights (see `hugepages`).
        self.huge_pages = HugePageReport("off")
        self._pages: HugePageLoad | None = None  # settled after the first generation

    def _settle_pages(self) -> None:
        pages, self._pages = self._pages, None
        if pages is not None:
            pages.settle()

    @classmethod
    def load(cls, path: str | Path, *, providers: str | Sequence[str] = "cpu",
             plan: ThreadPlan | None = None, verify_hashes: bool = True,
             load_draft: bool = True, cuda_graph: bool = False,
             device_argmax: bool | None = None, huge_pages: bool | None = None,
             two_row_steps: bool | None = None, split_head: bool = True,
             prefix_cache: int = 0) -> Pair:
        """Load a pair folder written by `specedge export`.

        Args:
            path: the pair folder.
            providers: one provider for both models ("cpu", "cuda", "tensorrt") or a pair
                (target, draft), e.g. ("cuda", "cpu").
            plan: explicit thread settings; default `plan_threads(...)` for the providers.
            verify_hashes: check every file's sha256 (default); skipping is logged.
            load_draft: False loads only the target (target-only or n-gram decoding).
            cuda_graph: capture and replay CUDA graphs for the models on "cuda" (off by
                default; see `SessionConfig.cuda_graph`).
            device_argmax: greedy argmax where the logits are (None: on for GPU providers,
                off on the CPU; see `SessionConfig.device_argmax`).
            huge_pages: put the CPU models' weights on transparent huge pages (None: on unless
                ``SPECEDGE_HUGE_PAGES=0``; see `hugepages`). The outcome is `pair.huge_pages`.
            two_row_steps: run the target's one-token steps as two rows, so that a decode step
                and a verification block compute a position with the same kernels and
                speculative output is target-only output token for token (None: when
                `rowprobe.probe_rows` finds the target's one-row kernels differ beyond rounding
                and its block kernels agree, e.g. MatMulNBits at accuracy level 4). The probe
                is `pair.target.row_probe`.
            split_head: where the exporter split a model's head off (manifest `head`), greedy
                argmaxes on the CPU read its int8 copy and compute only the candidates its
                bound leaves exactly (`runtime/shortlist`); False runs the whole graph.
            prefix_cache: keep the caches of this many finished generations (0: none), so that
                a prompt starting with an earlier prompt's tokens (a chat's next turn)
                prefills only the rest; the output is the same token for token
                (`runtime/prefix_cache`). Each kept generation holds its KV caches' memory.

        Raises:
            ManifestError: missing, malformed, tampered or unsafe pair folder.
            ModelError: a model file that ONNX Runtime cannot load.
            InputError: an unknown or unavailable provider.
        """
        if not isinstance(path, str | os.PathLike):
            raise InputError(f"Pair.load takes the pair folder's path, got "
                             f"{type(path).__name__}")
        if isinstance(prefix_cache, bool) or not isinstance(prefix_cache, int) or \
                not 0 <= prefix_cache <= 64:
            raise InputError(f"prefix_cache must be an integer in [0, 64], got {prefix_cache!r}")
        if plan is not None and not isinstance(plan, ThreadPlan):
            raise InputError(f"plan must be a ThreadPlan (or None), got {type(plan).__name__}")
        manifest = load_manifest(path, verify_hashes=verify_hashes)
        plan = session_plan(manifest, providers, plan, cuda_graph=cuda_graph,
                            device_argmax=device_argmax, split_head=split_head)
        tokenizer = Tokenizer.from_folder(manifest.root, bos_token_id=manifest.bos_token_id,
                                          eos_token_ids=manifest.eos_token_ids)
        if tokenizer.vocab_size > manifest.vocab_size:
            raise InputError(
                f"{manifest.root / 'tokenizer.json'}: the tokenizer has {tokenizer.vocab_size} "
                f"tokens but the models only {manifest.vocab_size}; re-export the pair"
            )
        notes: dict[str, str] = {}
        on_cpu = "cpu" in (plan.target.provider, plan.draft.provider if load_draft else "")
        with HugePageLoad(huge_pages if on_cpu else False) as pages:
            target, note = load_model(manifest, "target", plan.target,
                                      verify_hashes=verify_hashes)
            if note:
                notes["target"] = note
            draft = None
            if manifest.draft is not None and load_draft:
                draft, note = load_model(manifest, "draft", plan.draft,
                                         verify_hashes=verify_hashes)
                if note:
                    notes["draft"] = note
        if two_row_steps is None:
            target.row_probe = probe = probe_rows(target)
            if probe is not None:
                (log.info if probe.blocks_agree else log.warning)("target: %s", probe.describe())
            two_row_steps = probe is not None and probe.needs_two_rows
        target.two_row_steps = two_row_steps
        pair = cls(manifest, tokenizer, target, draft, prefix_cache)
        pair.engine_notes = notes
        pair.huge_pages = pages.report
        pair._pages = pages
        return pair

    # ------------------------------------------------------------------ prompts

    @property
    def template_variables(self) -> dict[str, Any]:
        """Chat template variables for every chat this pair renders (e.g. Qwen3's
        `enable_thinking`; `chat_template.template_variables`)."""
        return self.prompts.template_variables

    @template_variables.setter
    def template_variables(self, value: dict[str, Any]) -> None:
        self.prompts.template_variables = value

    def encode_prompt(self, prompt: Prompt, *, chat: bool = False) -> list[int]:
        """Token ids of a plain prompt, or of chat messages rendered by the chat template (a
        prompt of token ids is checked and taken as it is)."""
        return self.prompts.encode(prompt, chat=chat)

    def conversation_ids(self, prompt: Prompt, reply: str | Mapping[str, Any], *,
                         chat: bool = False) -> list[int]:
        """See `Prompts.conversation_ids`: what `prefill_ahead` takes."""
        return self.prompts.conversation_ids(prompt, reply, chat=chat)

    def check_ids(self, ids: Sequence[int]) -> list[int]:
        return self.prompts.check_ids(ids)

    # ------------------------------------------------------------------ generation

    def plan(self, config: GenerationConfig | None = None) -> DecodePlan:
        """How `config` decodes on this pair (drafter, K, adaptivity, context limit)."""
        config = as_config(config)
        return resolve_plan(self.manifest, has_draft=self.draft is not None,
                            drafter=config.drafter, k=config.num_draft_tokens,
                            adaptive=config.adaptive, draft_p_min=config.draft_p_min)

    def grammar_state(self, config: GenerationConfig) -> GrammarState | None:
        """A fresh matcher of `config.grammar` for one generation (None: free text)."""
        return None if config.grammar is None else self.grammars.state(config.grammar)

    def new_output(self, prompt_ids: Sequence[int], config: GenerationConfig, *,
                   text: bool = True) -> RowOutput:
        """The output tracker of one generation: budget, eos (or none, `ignore_eos`) and stop
        token ids, and (with text) stop strings."""
        eos = () if config.ignore_eos else tuple(self.manifest.eos_token_ids)
        return RowOutput(config.max_new_tokens, eos + config.stop_token_ids,
                         tokenizer=self.tokenizer if text else None, prompt_ids=prompt_ids,
                         stop=config.stop if text else (), top_logprobs=config.logprobs)

    def _decode(self, ids: list[int], config: GenerationConfig, stats: GenerationStats,
                output: RowOutput) -> Generator[list[int], None, str]:
        plan = self.plan(config)
        plan.check_prompt(len(ids))
        max_len = plan.cache_len(len(ids), config.max_new_tokens)
        stats.prompt_tokens = len(ids)
        entry, reused = None, 0
        if self.prefixes.size:
            max_len = cache_capacity(max_len, plan.limit)
            entry, reused = self.prefixes.take(ids, max_len)
        model_drafter = plan.drafter in MODEL_DRAFTERS and self.draft is not None
        draft_cache = entry.draft if entry is not None and model_drafter else None
        if draft_cache is not None:
            draft_cache.rollback(reused)
        if entry is not None:
            cache = entry.target
            cache.rollback(reused)
        else:
            cache = self.target.new_cache(1, max_len)
        drafter = build_drafter(plan.drafter, self.draft, max_len, plan.draft_p_min,
                                cache=draft_cache, fed=ids[:reused],
                                prompt_kv=cache if self.shares_prompt_kv else None)
        stats.cached_tokens = reused
        sampler = RowSampler(config.sampling, self.target.spec.vocab_size, ids,
                             self.grammar_state(config), output.eos)
        key = (1, plan.drafter, plan.k)
        tuner = self.tuners.take(key) if drafter is not None and plan.adaptive else None
        rounds = decode(self.target, cache, drafter, ids, plan, sampler, output, stats,
                        tuner=tuner)
        kept = (Entry(kept_prefix(ids), max_len, cache, draft_model_cache(drafter))
                if self.prefixes.size else None)
        return self._learning(rounds, key, tuner, kept)

    def _learning(self, rounds: Generator[list[int], None, str], key: tuple[int, str, int],
                  tuner: AdaptiveK | None, kept: Entry | None = None
                  ) -> Generator[list[int], None, str]:
        """`rounds`, keeping what its tuner learned once the generation ends (an abandoned
        stream keeps nothing), and its caches for the next prompt that starts alike (`kept`;
        also when the stream is abandoned once the prefill is done, not after a failure)."""
        prefilled = False
        try:
            while True:
                try:
                    tokens = next(rounds)
                except StopIteration as done:
                    reason: str = done.value
                    break
                prefilled = True
                yield tokens
        except GeneratorExit:
            rounds.close()
            if prefilled and kept is not None:
                self.prefixes.put(kept)
            raise
        self.tuners.keep(key, tuner)
        self._settle_pages()
        if kept is not None:
            self.prefixes.put(kept)
        return reason

    def prompt_logprobs(self, ids: Sequence[int], top: int = 0) -> list[TokenLogprob]:
        """The target's log-probability of each token of `ids` after the first (with its `top`
        most likely alternatives): the prompt's logprobs a completion with `echo` reports, and
        a text's likelihood under the pair (`runtime/prefix_cache.prompt_logprobs`).

        Raises:
            InputError: ids outside the vocabulary, or more than the context holds.
        """
        ids = self.check_ids(ids)
        self.plan().check_prompt(len(ids))
        return prompt_logprobs(self.target, ids, top)

    def prefill_ahead(self, ids: Sequence[int]) -> int:
        """Prefill `ids` into the kept caches that share the most with them (whole chunks, see
        `runtime/prefix_cache`), so that a later prompt starting with `ids`, such as the next
        turn of a conversation (its last prompt, the reply's tokens and the next message),
        prefills only what follows. Meant for idle time: after a reply is shown, before the
        next message arrives. Returns how many of `ids` the caches now hold (0 without a kept
        cache that shares a whole chunk with them, or without prefix caching).

        Raises:
            ModelError: a model failed to run (the caches are then dropped).
        """
        ids = self.check_ids(ids)
        entry = self.prefixes.take_extendable(ids)
        if entry is None:
            return 0
        extend(entry, len(entry.ids), ids, (self.target, self.draft),
               share_prompt_kv=self.shares_prompt_kv)
        self.prefixes.put(entry)
        return len(entry.ids)

    def stream_tokens(self, prompt_ids: Sequence[int], config: GenerationConfig | None = None,
                      stats: GenerationStats | None = None
                      ) -> Generator[list[int], None, str]:
        """Yield the token ids kept by each round (the lowest-level API; stop strings are a
        text matter and are not applied here)."""
        start = time.perf_counter()
        config = as_config(config)
        ids = self.check_ids(prompt_ids)
        stats = stats if stats is not None else GenerationStats()
        return _timed(self._decode(ids, config, stats, self.new_output(ids, config, text=False)),
                      stats, start)

    def open(self, prompt: Prompt, config: GenerationConfig | None = None,
             stats: GenerationStats | None = None
             ) -> tuple[list[int], RowOutput, Generator[list[int], None, str]]:
        """A generation as its parts: the prompt's ids; its output, which the rounds fill
        (tokens, text and `delta()`, stop strings, logprobs); and the rounds, each yielding the
        tokens it kept (close it to abandon the generation). What `stream` runs, for callers
        that read the output between rounds (the server). `stats` is complete, `total_s`
        included, when the rounds end or are closed."""
        config = as_config(config)
        start = time.perf_counter()
        stats = stats if stats is not None else GenerationStats()
        ids, config = self.prompts.prepare(prompt, config)
        output = self.new_output(ids, config)
        return ids, output, _timed(self._decode(ids, config, stats, output), stats, start)

    def stream(self, prompt: Prompt, config: GenerationConfig | None = None,
               stats: GenerationStats | None = None
               ) -> Generator[str, None, GenerationResult]:
        """Yield text deltas as they are generated (multi-byte safe, stop strings honoured)."""
        stats = stats if stats is not None else GenerationStats()
        ids, output, rounds = self.open(prompt, config, stats)
        try:
            for _ in rounds:
                if delta := output.delta():
                    yield delta
            output.finish()  # flushes the detokenizer: its held-back bytes
            if delta := output.delta():
                yield delta
        finally:
            rounds.close()
        return GenerationResult.of(output, ids, stats)

    def generate(self, prompt: Prompt, config: GenerationConfig | None = None) -> GenerationResult:
        """Generate a completion for a prompt (str) or chat messages (list of dicts)."""
        gen = self.stream(prompt, config, GenerationStats())
        while True:
            try:
                next(gen)
            except StopIteration as done:
                result: GenerationResult = done.value
                return result

    def generate_ids(self, prompt_ids: Sequence[int], config: GenerationConfig | None = None
                     ) -> tuple[list[int], str, GenerationStats]:
        """Token-level generation (no detokenization): (new ids, stop reason, stats)."""
        stats = GenerationStats()
        gen = self.stream_tokens(prompt_ids, config, stats)
        out: list[int] = []
        while True:
            try:
                out.extend(next(gen))
            except StopIteration as done:
                return out, str(done.value), stats

    def generate_batch(self, prompts: Sequence[Prompt],
                       configs: GenerationConfig | Sequence[GenerationConfig] | None = None, *,
                       compact: bool = True) -> BatchResult:
        """Generate for several prompts at once: one target call per round for all rows.

        Each row has its own sampling parameters, seed, token budget and stop strings (one
        config per prompt, or one for all); the drafter, k and adaptivity are shared by the
        batch. Each row's output is what `generate` gives it alone (greedy and seeded: token for
        token; unseeded: the same distribution). Needs a pair exported with `--graph concat`.
        With adaptive K, the costs and acceptance learned by a batch are kept per batch size
        and warm-start the next batch of that size (the first one of a size: of the nearest
        size) on this `Pair`.
        """
        if isinstance(prompts, str) or not prompts:
            raise InputError("generate_batch takes a non-empty list of prompts")
        start = time.perf_counter()
        configs = row_configs(len(prompts), configs)
        prepared = [self.prompts.prepare(p, c) for p, c in zip(prompts, configs, strict=True)]
        return self._batch([ids for ids, _ in prepared], [c for _, c in prepared], compact,
                           start, text=True)

    def generate_batch_ids(self, prompt_ids: Sequence[Sequence[int]],
                           configs: GenerationConfig | Sequence[GenerationConfig] | None = None,
                           *, compact: bool = True) -> BatchResult:
        """Token-level `generate_batch` (no detokenization: stop strings do not apply and the
        results' texts are empty); the same decoding, plan and tuners."""
        rows = [] if isinstance(prompt_ids, str | bytes) else list(prompt_ids)
        if not rows or not all(isinstance(ids, Sequence | np.ndarray)
                               and not isinstance(ids, str | bytes) and len(ids) for ids in rows):
            raise InputError("generate_batch_ids takes a non-empty list of non-empty token-id "
                             "prompts")
        start = time.perf_counter()
        configs = row_configs(len(rows), configs)
        return self._batch([self.check_ids(ids) for ids in rows], configs, compact,
                           start, text=False)

    def _batch(self, ids_list: list[list[int]], configs: Sequence[GenerationConfig],
               compact: bool, start: float, *, text: bool) -> BatchResult:
        plan = self.plan(configs[0])
        for ids in ids_list:
            plan.check_prompt(len(ids))
        max_len = plan.cache_len(max(len(i) + c.max_new_tokens
                                     for i, c in zip(ids_list, configs, strict=True)), 0)
        requests = [RowRequest(prompt=ids, output=self.new_output(ids, c, text=text),
                               params=c.sampling, grammar=self.grammar_state(c))
                    for ids, c in zip(ids_list, configs, strict=True)]
        key = (len(ids_list), plan.drafter, plan.k)
        # A batch prefills the draft only if it starts drafting: weighed with the drafts.
        tuner = self.tuners.take(key, [len(ids) for ids in ids_list]) if plan.adaptive else None
        rows, totals = decode_batch(self.target, self.draft, plan, requests, max_len=max_len,
                                    compact=compact, tuner=tuner,
                                    share_prompt_kv=self.shares_prompt_kv)
        self.tuners.keep(key, tuner)
        results = []
        for row, ids in zip(rows, ids_list, strict=True):
            row.stats.total_s = time.perf_counter() - start
            results.append(GenerationResult.of(row.output, ids, row.stats))
        totals.total_s = time.perf_counter() - start
        self._settle_pages()
        return BatchResult(results=results, stats=totals)

    def info(self) -> dict[str, Any]:
        from .manifest import describe

        return dict(describe(self.manifest))
