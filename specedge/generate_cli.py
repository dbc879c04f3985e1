"""`specedge generate` and `specedge chat`: text from a pair, streamed, one prompt, a batch
file of rows, or a conversation. Registered in the `specedge` group by `specedge/cli.py`."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from specedge.batch_file import read_batch_file
from specedge.cli_base import PREFIX_CACHE_HELP, LoadOptions, load_options, new_table, print_table
from specedge.cli_errors import clean_errors, one_line
from specedge.generation_options import GenerationOptions, generation_options
from specedge.runtime.errors import InputError, SpecEdgeError
from specedge.runtime.files import json_dumps
from specedge.runtime.logprobs import MAX_TOP_LOGPROBS

if TYPE_CHECKING:
    from specedge.runtime.pair import GenerationConfig, GenerationResult, Pair
    from specedge.runtime.reasoning import ReasoningFormat
    from specedge.runtime.reply_reader import ReplyPart, ReplyReader
    from specedge.runtime.tool_calls import ToolFormat


def _print_stats(result: GenerationResult) -> None:
    s = result.stats
    rows = [
        ("stop reason", result.stop_reason),
        ("prompt / new tokens", f"{s.prompt_tokens} / {s.new_tokens}"),
        ("prompt tokens reused (prefix cache)", str(s.cached_tokens)),
        ("rounds", str(s.rounds)),
        ("proposed / accepted drafts", f"{s.proposed} / {s.accepted}"),
        ("acceptance rate", f"{s.acceptance_rate:.1%}"),
        ("mean tokens per round", f"{s.mean_accepted_length:.2f}"),
        ("draft / target calls", f"{s.draft_calls} / {s.target_calls}"),
        ("prefill / draft / verify / host (s)",
         f"{s.prefill_s:.3f} / {s.draft_s:.3f} / {s.verify_s:.3f} / {s.host_s:.3f}"),
        ("decode tokens/s", f"{s.tokens_per_s:.1f}"),
        ("end-to-end tokens/s", f"{s.end_to_end_tokens_per_s:.1f}"),
    ]
    print_table(new_table("statistics", ("", ""), rows, show_header=False), stderr=True)


def _stream(loaded: Pair, prompt: Any, config: GenerationConfig,
            reader: ReplyReader | None = None) -> GenerationResult:
    """Echo the deltas of one generation as they come; returns its result. With `reader` (a
    reasoning model's chat), the thinking is echoed dim and the answer after it on a line of
    its own, each as `reader` reads it (`ReplyPart`s: the tags and the whitespace around them
    dropped, as the server gives them)."""
    gen = loaded.stream(prompt, config)
    shown = {"reasoning": False, "content": False}

    def echo(part: ReplyPart) -> None:
        if part.reasoning:
            click.echo(click.style(part.reasoning, dim=True), nl=False)
            shown["reasoning"] = True
        if part.content:
            if shown["reasoning"] and not shown["content"]:
                click.echo("\n")
            click.echo(part.content, nl=False)
            shown["content"] = True

    while True:
        try:
            delta = next(gen)
        except StopIteration as done:
            if reader is not None:
                echo(reader.finish())
            click.echo()
            return done.value  # type: ignore[no-any-return]
        if reader is None:
            click.echo(delta, nl=False)
        else:
            echo(reader.feed(delta))


def _logprobs(loaded: Pair, result: GenerationResult) -> dict[str, Any]:
    """`{"logprobs": [...]}` for --json (empty when none were asked for): each generated
    token's id, text, log-probability and top alternatives."""
    if result.logprobs is None:
        return {}

    def one(token: int, logprob: float) -> dict[str, Any]:
        text = loaded.tokenizer.token_bytes(token).decode("utf-8", errors="replace")
        return {"id": token, "token": text, "logprob": logprob}

    return {"logprobs": [{**one(e.token, e.logprob), "top": [one(t, lp) for t, lp in e.top]}
                         for e in result.logprobs]}


def _generate_batch(loaded: Pair, batch_file: Path, config: GenerationConfig, show_stats: bool,
                    as_json: bool) -> None:
    rows = read_batch_file(batch_file, config)
    for prompt, cfg, where in zip(rows.prompts, rows.configs, rows.where, strict=True):
        try:  # the row's own errors (template, length, context) name its line
            loaded.plan(cfg).check_prompt(len(loaded.encode_prompt(prompt, chat=cfg.chat)))
        except InputError as exc:
            raise InputError(f"{where}: {exc}") from None
    result = loaded.generate_batch(rows.prompts, rows.configs)
    for i, row in enumerate(result.results):
        if as_json:
            click.echo(json_dumps({"row": i, "text": row.text,
                                   **_chat_fields(loaded, rows.prompts[i],
                                                  rows.configs[i].chat, row.text),
                                   "tokens": row.tokens,
                                   "stop_reason": row.stop_reason,
                                   "stats": row.stats.to_dict(), **_logprobs(loaded, row)}))
        else:
            click.echo(f"[{i}] {row.text}")
    st = result.stats
    if show_stats or as_json:
        summary = {"rows": st.rows, "rounds": st.rounds, "new_tokens": st.new_tokens,
                   "prompt_tokens": sum(r.stats.prompt_tokens for r in result.results),
                   # prompt tokens copied from another row or kept in a slot, not computed
                   "cached_tokens": sum(r.stats.cached_tokens for r in result.results),
                   "acceptance_rate": st.acceptance_rate, "prefill_s": st.prefill_s,
                   "decode_s": st.decode_s, "aggregate_tokens_per_s": st.tokens_per_s}
        if as_json:
            click.echo(json_dumps({"batch": summary}))
        else:
            click.echo(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                                for k, v in summary.items()), err=True)


def _reply_fields(loaded: Pair, rendered: str, text: str, tools: ToolFormat | None,
                  calls: bool) -> dict[str, Any]:
    """A chat reply as the server returns it (`runtime/reply_reader`): a reasoning model's
    thinking apart as `reasoning`, the answer as `content`, and with `calls` the calls in
    `tools`' format read from the answer (none when `tools` is None: a template that takes
    tools but writes no format known here). `rendered`: the prompt, which may have opened the
    thinking block."""
    from specedge.runtime.reply_reader import ReplyReader

    reasoning = loaded.prompts.reasoning
    found = ReplyReader(tools, reasoning,
                        reasoning is not None and reasoning.opened_by(rendered)).read(text)
    out: dict[str, Any] = {"content": found.content or None}
    if reasoning is not None:
        out["reasoning"] = found.reasoning or None
    if calls:
        out["tool_calls"] = [{"name": c.name, "arguments": c.arguments} for c in found.calls]
    return out


def _chat_fields(loaded: Pair, prompt: Any, chat: bool, text: str) -> dict[str, Any]:
    """`_reply_fields` of a reasoning model's reply to a chat prompt (messages, or a str with
    `chat`); {} for a plain model or prompt."""
    if loaded.prompts.reasoning is None:
        return {}
    rendered = loaded.prompts.chat_text(prompt, chat)
    return {} if rendered is None else _reply_fields(loaded, rendered, text, None, False)


def _generate_with_tools(loaded: Pair, prompt: str, config: GenerationConfig, tools_file: Path,
                         tool_choice: str | None, as_json: bool, show_stats: bool) -> None:
    """PROMPT as a user turn offered the tools of `tools_file` (as the server's `tools`): the
    reply streamed, or with --json its text, content and calls."""
    from specedge.runtime.errors import FieldError
    from specedge.runtime.prompts import read_text_file
    from specedge.runtime.tool_prompt import ToolPlan
    from specedge.runtime.tool_set import ToolSet

    try:
        listed = json.loads(read_text_file(tools_file, "the tools file", "tools file"))
    except (json.JSONDecodeError, RecursionError):
        raise InputError(f"{tools_file}: not JSON; give a list of tools, each {{\"type\": "
                         "\"function\", \"function\": {\"name\": ..., \"parameters\": "
                         "{...}}}") from None
    choice: Any = tool_choice
    if tool_choice not in (None, "auto", "none", "required"):
        choice = {"type": "function", "function": {"name": tool_choice}}
    try:
        tools = ToolSet.from_openai(listed, choice)
    except FieldError as exc:
        raise InputError(f"{tools_file}: {exc.param}: {exc}") from None
    plan = ToolPlan.for_tokenizer(loaded.tokenizer, tools)
    if plan.grammar is not None and config.grammar is not None:
        raise InputError("give --json-schema/--regex/--grammar or a --tool-choice that forces "
                         "calls, not both")
    messages = [{"role": "user", "content": prompt}]
    text = plan.prompt_text(loaded.tokenizer, messages, loaded.template_variables)
    ids, config = loaded.prompts.rendered(text, dataclasses.replace(
        config, chat=False, grammar=plan.grammar or config.grammar))
    if not as_json:
        result = _stream(loaded, ids, config)
        if show_stats:
            _print_stats(result)
        return
    result = loaded.generate(ids, config)
    click.echo(json_dumps({"text": result.text,
                           **_reply_fields(loaded, text, result.text,
                                           plan.fmt if plan.parses_calls else None, True),
                           "tokens": result.tokens, "stop_reason": result.stop_reason,
                           "stats": result.stats.to_dict(), **_logprobs(loaded, result)}))


@click.command()
@click.argument("pair", type=click.Path(path_type=Path))
@click.argument("prompt", required=False)
@generation_options
@load_options
@click.option("--chat", is_flag=True, help="Wrap PROMPT in the chat template as a user turn.")
@click.option("--tools", "tools_file", type=click.Path(path_type=Path), default=None,
              help="A JSON file listing OpenAI function tools: PROMPT is a user turn that may "
                   "call them (as the server's tools); --json adds the calls.")
@click.option("--tool-choice", default=None, metavar="auto|none|required|NAME",
              help="With --tools: the reply may call tools (auto), may not (none), must "
                   "(required), or must call tool NAME.")
@click.option("--batch", "batch_file", type=click.Path(path_type=Path), default=None,
              help="JSONL file, one row per line: {\"prompt\": ...} or {\"messages\": [...]}, "
                   "with optional max_new_tokens, temperature, top_k, top_p, min_p, seed, "
                   "presence_penalty, frequency_penalty, repetition_penalty, logit_bias, stop, "
                   "chat, response_format, structured_outputs, min_tokens, ignore_eos (as the "
                   "server's). Generates all "
                   "rows as one "
                   "batch (needs a --graph concat pair).")
@click.option("--stats", "show_stats", is_flag=True, help="Print statistics (to stderr).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (text + stats).")
@click.option("--logprobs", "top_logprobs", default=None, type=click.IntRange(0, MAX_TOP_LOGPROBS),
              help="With --json: each generated token's log-probability under the target and "
                   "its N most likely alternatives.")
@clean_errors
def generate(pair: Path, prompt: str | None, generation: GenerationOptions, load: LoadOptions,
             chat: bool, tools_file: Path | None, tool_choice: str | None,
             batch_file: Path | None, show_stats: bool, as_json: bool,
             top_logprobs: int | None) -> None:
    """Generate a completion of PROMPT (or of every row of --batch) with the pair PAIR."""
    if (prompt is None) == (batch_file is None):
        raise click.UsageError("give a PROMPT or --batch FILE (one of the two)")
    if top_logprobs is not None and not as_json:
        raise click.UsageError("--logprobs prints with --json; add --json")
    if tool_choice is not None and tools_file is None:
        raise click.UsageError("--tool-choice needs --tools FILE")
    if tools_file is not None and batch_file is not None:
        raise click.UsageError("--tools takes a PROMPT, not --batch")
    config = dataclasses.replace(generation.config(chat), logprobs=top_logprobs)
    loaded = load.load(pair)
    if tools_file is not None:
        assert prompt is not None
        _generate_with_tools(loaded, prompt, config, tools_file, tool_choice, as_json,
                             show_stats)
        return
    if batch_file is not None:
        _generate_batch(loaded, batch_file, config, show_stats, as_json)
        return
    assert prompt is not None
    if as_json:
        result = loaded.generate(prompt, config)
        click.echo(json_dumps({"text": result.text,
                               **_chat_fields(loaded, prompt, chat, result.text),
                               "tokens": result.tokens,
                               "stop_reason": result.stop_reason,
                               "stats": result.stats.to_dict(), **_logprobs(loaded, result)}))
        return
    result = _stream(loaded, prompt, config)
    if show_stats:
        _print_stats(result)


@click.command()
@click.argument("pair", type=click.Path(path_type=Path))
@generation_options
@load_options
@click.option("--system", default=None, help="System message.")
@click.option("--stats", "show_stats", is_flag=True, help="Print statistics after each reply.")
@click.option("--prefix-cache", default=1, show_default=True, type=click.IntRange(0, 64),
              help=PREFIX_CACHE_HELP)  # a LoadOptions field: it arrives in `load`
@clean_errors
def chat(pair: Path, generation: GenerationOptions, load: LoadOptions, system: str | None,
         show_stats: bool) -> None:
    """Chat with the pair in folder PAIR (empty line or Ctrl-D to quit).

    When the conversation outgrows the context, the oldest exchanges are dropped (and named on
    stderr); a turn that fails prints its error and the conversation goes on.
    """
    from specedge.runtime.reply_reader import ReplyReader
    from specedge.runtime.text import check_text

    if sys.stdin is None:
        raise InputError("chat reads its turns from stdin, which is closed; run it in a "
                         "terminal or pipe the turns in")
    if system is not None:
        check_text(system, "--system")
    config = generation.config(False)
    loaded = load.load(pair)  # with --prefix-cache (chat's own option)
    if hasattr(sys.stdin, "reconfigure"):
        # Undecodable input becomes lone surrogates, refused per turn, instead of ending the
        # chat with a UnicodeDecodeError.
        sys.stdin.reconfigure(errors="surrogateescape")
    head: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    turns: list[dict[str, str]] = []  # user, assistant, user, assistant, ...
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        try:
            kept, dropped = _fit_context(loaded, head, turns + [
                {"role": "user", "content": line}], config)
            thinking = _thinking(loaded, head + kept)
            result = _stream(loaded, head + kept, config,
                             ReplyReader(None, *thinking) if thinking else None)
        except SpecEdgeError as exc:
            click.echo(f"error: {one_line(str(exc))}", err=True)
            continue  # the conversation is as it was before this turn (nothing dropped)
        if dropped:  # only once the turn has happened: a failed turn drops nothing
            click.echo(_dropped_note(dropped, loaded.plan(config).limit), err=True)
        reply = _assistant_turn(result.text, thinking)
        turns = kept + [reply]
        if show_stats:
            _print_stats(result)
        try:  # while the user reads: the next turn starts with this conversation
            loaded.prefill_ahead(loaded.conversation_ids(head + kept, reply))
        except SpecEdgeError as exc:
            click.echo(f"error: {one_line(str(exc))}", err=True)


def _thinking(loaded: Pair, messages: list[dict[str, str]]
              ) -> tuple[ReasoningFormat, bool] | None:
    """A reasoning model's format, and whether the prompt of `messages` opens its thinking
    block (None: not a reasoning model)."""
    reasoning = loaded.prompts.reasoning
    if reasoning is None:
        return None
    rendered = loaded.prompts.chat_text(messages)
    assert rendered is not None  # messages
    return reasoning, reasoning.opened_by(rendered)


def _assistant_turn(text: str, thinking: tuple[ReasoningFormat, bool] | None
                    ) -> dict[str, str]:
    """The reply as the conversation's next assistant message: a reasoning model's answer as
    `content` and its thinking as `reasoning_content`, as clients send them back to a server
    (a reasoning template renders or drops earlier thinking itself); the whole text otherwise."""
    from specedge.runtime.reply_reader import ReplyReader

    if thinking is None:
        return {"role": "assistant", "content": text}
    part = ReplyReader(None, *thinking).read(text)
    turn = {"role": "assistant", "content": part.content}
    if part.reasoning:
        turn["reasoning_content"] = part.reasoning
    return turn


def _fit_context(loaded: Pair, head: list[dict[str, str]], turns: list[dict[str, str]],
                 config: GenerationConfig) -> tuple[list[dict[str, str]], list[str]]:
    """The turns that fit the context with room to answer: the oldest exchanges (a user
    message and its reply) go first, the last message always stays. Returns (kept, the first
    words of each dropped exchange)."""
    limit = loaded.plan(config).limit
    room = min(config.max_new_tokens, max(1, limit // 4))
    dropped: list[str] = []
    while len(turns) > 1 and len(loaded.encode_prompt(head + turns)) + room > limit:
        dropped.append(turns[0]["content"])
        turns = turns[2:]
    return turns, dropped


def _dropped_note(dropped: list[str], limit: int) -> str:
    shown = ", ".join(repr(text[:30] + ("..." if len(text) > 30 else "")) for text in dropped)
    return one_line(f"note: the conversation outgrew the context of {limit} tokens: dropped "
                     f"the oldest {len(dropped)} exchange(s), starting {shown}")
