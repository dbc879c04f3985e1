"""`specedge serve`: run the OpenAI-compatible server (`runtime.server`) under uvicorn.

Needs the `[serve]` extra (starlette, uvicorn). Registered on the CLI group by `specedge.cli`;
`python -m specedge.serve_cli PAIR ...` runs it too.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from specedge.cli_base import CHAT_TEMPLATE_KWARGS_HELP, PREFIX_CACHE_HELP, template_kwargs_option
from specedge.cli_errors import one_line
from specedge.runtime.errors import InputError, SpecEdgeError
from specedge.runtime.policy import DRAFTER_CHOICES

if TYPE_CHECKING:
    from specedge.runtime.scheduler import Scheduler

log = logging.getLogger("specedge.serve")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _check_listen(host: str, port: int) -> None:
    """Fail before the pair loads, in one line, where uvicorn could not listen (the port taken,
    a host that does not resolve or is not this machine's): uvicorn would log several lines
    after loading and exit 3. It binds with SO_REUSEADDR, so this does too."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as exc:
        raise InputError(f"cannot listen on {host}:{port} ({exc}); give --host an address "
                         "of this machine (127.0.0.1, 0.0.0.0)") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            raise InputError(f"cannot listen on {host}:{port} ({exc.strerror or exc}); choose "
                             "another --port or --host") from None


def _describe(scheduler: Scheduler, host: str, port: int, keyed: bool) -> str:
    mode = (f"continuous batching of {scheduler.options.max_batch}" if scheduler.batched
            else "batch-1 FIFO (gqa-shared pair)")
    auth = "API key required" if keyed else "no API key"
    return f"specedge serve: {mode}, {auth}, on http://{host}:{port}/v1"


@click.command()
@click.argument("pair", type=click.Path(path_type=Path))
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Interface to listen on (0.0.0.0: every interface; use --api-key).")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535))
@click.option("--api-key", default=None, envvar="SPECEDGE_API_KEY", show_default=False,
              help="Require 'Authorization: Bearer KEY' (or set SPECEDGE_API_KEY).")
@click.option("--model-name", default=None, help="Model id for clients (default: PAIR's name).")
@click.option("--max-batch", default=4, show_default=True, type=click.IntRange(1, 256),
              help="Requests decoding together (concat-form pairs).")
@click.option("--prefill-budget", default=256, show_default=True,
              type=click.IntRange(0, 1_000_000),
              help="Prompt tokens prefilled between two rounds while requests decode "
                   "(concat-form pairs: a long prompt joins in chunks without stalling the "
                   "others; 0: whole prompts at once).")
@click.option("--max-queue", default=16, show_default=True, type=click.IntRange(0, 100_000),
              help="Requests waiting beyond the running ones; more get 429.")
@click.option("--max-tokens-limit", default=512, show_default=True,
              type=click.IntRange(1, 1_000_000), help="Largest max_tokens per request.")
@click.option("--max-context", default=2048, show_default=True,
              type=click.IntRange(2, 1_000_000), help="Prompt + completion tokens per request.")
@click.option("--max-body-bytes", default=1 << 20, show_default=True,
              type=click.IntRange(1024, 1 << 30), help="Largest request body.")
@click.option("--receive-timeout", default=30.0, show_default=True,
              type=click.FloatRange(min=0, min_open=True),
              help="Seconds a client may take to send a request: its head (from connecting, "
                   "or from the previous response) and then its body; slower clients are "
                   "disconnected (a late body gets 408).")
@click.option("--request-timeout", default=300.0, show_default=True,
              type=click.FloatRange(min=0, min_open=True), help="Seconds per request.")
@click.option("--warmup-tokens", default=8, show_default=True, type=click.IntRange(0, 4096),
              help="Tokens decoded for a short prompt before listening, so the first request "
                   "finds the sessions and adaptive K warm (0: no warm-up).")
@click.option("--drafter", default=None, type=click.Choice(DRAFTER_CHOICES))
@click.option("--num-draft-tokens", "-k", default=None, type=click.IntRange(1, 64),
              help="Draft length K (default: the pair's).")
@click.option("--no-speculation", is_flag=True, help="Target-only decoding.")
@click.option("--adaptive/--fixed-k", default=None,
              help="Adapt K to measured acceptance and cost (default: the pair's).")
@click.option("--providers", default="cpu", show_default=True,
              help="Execution provider, or TARGET,DRAFT (e.g. cuda,cpu).")
@click.option("--threads", default=None, help="Intra-op threads, or TARGET,DRAFT.")
@click.option("--no-verify", is_flag=True, help="Skip the sha256 check of the model files.")
@click.option("--head", default="split", show_default=True, type=click.Choice(["split", "whole"]),
              help="split: greedy argmaxes from the int8 shortlist where the head is split off "
                   "(CPU; faster, more memory); whole: the whole graph (less memory).")
@click.option("--prefix-cache", default=1, show_default=True, type=click.IntRange(0, 64),
              help=PREFIX_CACHE_HELP + " A continuously batched (concat-form) server keeps "
                   "them in its free slots instead (any N > 0).")
@click.option("--chat-template-kwargs", "template_kwargs", default=None, metavar="JSON",
              help=CHAT_TEMPLATE_KWARGS_HELP + " A request's chat_template_kwargs override "
                   "them.")
@click.option("--reasoning-format", default="auto", show_default=True,
              type=click.Choice(["auto", "none"]),
              help="auto: a reasoning model's thinking (<think>...</think>, found in its chat "
                   "template) is returned apart as reasoning_content; none: left in the "
                   "content.")
@click.option("--constrain-thinking", is_flag=True,
              help="Structured output (response_format, a forced tool_choice) constrains a "
                   "reasoning model's thinking too; by default it constrains the answer after "
                   "the thinking, which stays free.")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["critical", "error", "warning", "info", "debug"]))
def serve(pair: Path, host: str, port: int, api_key: str | None, model_name: str | None,
          max_batch: int, prefill_budget: int, max_queue: int, max_tokens_limit: int,
          max_context: int,
          max_body_bytes: int, receive_timeout: float, request_timeout: float,
          warmup_tokens: int, drafter: str | None,
          num_draft_tokens: int | None, no_speculation: bool, adaptive: bool | None,
          providers: str, threads: str | None, no_verify: bool, head: str,
          prefix_cache: int, template_kwargs: str | None, reasoning_format: str,
          constrain_thinking: bool, log_level: str) -> None:
    """Serve PAIR with an OpenAI-compatible API (chat, completions, streaming).

    Concat-form pairs decode requests in one continuously batched speculative loop; gqa-shared
    pairs one at a time. Listens on 127.0.0.1 unless --host says otherwise.
    """
    try:
        import uvicorn

        from specedge.runtime.http_deadline import request_deadline_protocol
        from specedge.runtime.server import ServerOptions, create_app
    except ImportError as exc:
        click.echo(f"error: specedge serve needs the [serve] extra ({exc.name} is missing): "
                   "pip install 'specedge[serve]'", err=True)
        sys.exit(1)
    from specedge.cli_base import LoadOptions

    # specedge's own lines at --log-level, as uvicorn's look (the group's root handler, set for
    # the other commands, shows warnings only: it hid the line that says where the server is)
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
    ours = logging.getLogger("specedge")
    ours.handlers[:], ours.propagate = [handler], False
    ours.setLevel(log_level.upper())
    try:
        _check_listen(host, port)
        options = ServerOptions(host=host, port=port, api_key=api_key, model_name=model_name,
                                max_batch=max_batch, prefill_budget=prefill_budget,
                                max_queue=max_queue,
                                max_tokens_limit=max_tokens_limit, max_context=max_context,
                                max_body_bytes=max_body_bytes, receive_timeout_s=receive_timeout,
                                request_timeout_s=request_timeout,
                                drafter="none" if no_speculation else drafter,
                                num_draft_tokens=num_draft_tokens, adaptive=adaptive,
                                warmup_tokens=warmup_tokens,
                                template_variables=template_kwargs_option(template_kwargs),
                                reasoning_format=reasoning_format,
                                constrain_thinking=constrain_thinking)
        loaded = LoadOptions(providers=providers, threads=threads, no_verify=no_verify,
                             head=head, prefix_cache=prefix_cache).load(pair)
        app = create_app(loaded, options)
        app.state.scheduler.warm_up()  # here, so that a failure is one line, not a traceback
    except SpecEdgeError as exc:
        click.echo(f"error: {one_line(str(exc))}", err=True)
        sys.exit(1)
    except OSError as exc:
        where = f"{exc.filename}: " if exc.filename else ""
        click.echo(f"error: {one_line(where + str(exc.strerror or exc))}", err=True)
        sys.exit(1)
    os.environ.pop("SPECEDGE_API_KEY", None)  # child processes need not see it
    if not _is_loopback(host) and api_key is None:
        log.warning("listening on %s without --api-key: anyone who can reach this port can "
                    "use the model", host)
    log.info(_describe(app.state.scheduler, host, port, api_key is not None))
    uvicorn.run(app, host=host, port=port, log_level=log_level, server_header=False,
                timeout_graceful_shutdown=5, http=request_deadline_protocol(receive_timeout))


if __name__ == "__main__":
    serve()
