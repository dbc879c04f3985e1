"""A pair's chat template as a file: from a GGUF's metadata, from a `--chat-template` file (read
bounded), and checked by rendering one user turn in the runtime's sandbox, so that a template that
cannot serve a chat fails the export, not the first chat.
"""

from __future__ import annotations

import json
from pathlib import Path

from specedge.runtime.errors import InputError

from .folder_files import read_json_file


def gguf_chat_template(gguf: Path) -> str | None:
    """The `tokenizer.chat_template` string of a GGUF file's metadata, or None."""
    from gguf import GGUFReader

    field = GGUFReader(str(gguf)).fields.get("tokenizer.chat_template")
    if field is None or not field.data:
        return None
    value = bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
    return value if value.strip() else None


def set_chat_template(folder: Path, template: str) -> None:
    """Write chat_template.jinja and mirror it into tokenizer_config.json."""
    (folder / "chat_template.jinja").write_text(template, encoding="utf-8")
    cfg_file = folder / "tokenizer_config.json"
    cfg = read_json_file(cfg_file) if cfg_file.is_file() else {}
    if not isinstance(cfg.get("chat_template"), str):
        cfg["chat_template"] = template
        cfg_file.write_text(json.dumps(cfg, indent=2, ensure_ascii=False), encoding="utf-8")


MAX_CHAT_TEMPLATE_BYTES = 1 << 20


def read_chat_template(file: Path) -> str:
    """The text of a `--chat-template` file, once it renders a user turn (`check_chat_template`).

    Raises:
        InputError: the file is missing, unreadable, larger than 1 MiB, not UTF-8, empty, not a
            jinja template, or its template fails or renders no user message.
    """
    where = f"--chat-template {file}"
    text = read_chat_template_text(Path(file).expanduser(), where)
    check_chat_template(text, where, "fix the template")
    return text


def read_chat_template_text(file: Path, where: str) -> str:
    """A chat template file's text: bounded (a device such as /dev/zero, or a huge file given
    by mistake, is not read whole; a template is a few KiB, with tool calls tens of KiB), a
    byte-order mark dropped (it would start every prompt).

    Raises:
        InputError: missing, a folder, unreadable, larger than 1 MiB, not UTF-8 or empty.
    """
    try:
        with open(file, "rb") as fh:
            data = fh.read(MAX_CHAT_TEMPLATE_BYTES + 1)
        if len(data) > MAX_CHAT_TEMPLATE_BYTES:
            raise InputError(f"{where}: larger than {MAX_CHAT_TEMPLATE_BYTES >> 20} MiB; a chat "
                             "template is a few KiB: give the template file")
        text = data.decode("utf-8-sig")
    except FileNotFoundError:
        raise InputError(f"{where}: no such file") from None
    except IsADirectoryError:
        raise InputError(f"{where}: is a folder; give a jinja file") from None
    except OSError as exc:
        raise InputError(f"{where}: cannot read it ({exc.strerror or exc})") from None
    except UnicodeDecodeError as exc:
        raise InputError(f"{where}: not UTF-8 text (byte {exc.start}); save it as UTF-8") from None
    if not text.strip():
        raise InputError(f"{where}: the file is empty")
    return text


def check_chat_template(text: str, where: str, fix: str) -> None:
    """Render `text` for one user turn in the runtime's sandbox, as `generate --chat` and the
    server will: a template that is not valid jinja, fails, exceeds the sandbox's limits or
    leaves the user's message out fails the export now, not at the first chat.

    Raises:
        InputError: naming `where`, with `fix`.
    """
    import jinja2

    from specedge.runtime.chat_template import ChatTemplate
    from specedge.runtime.template_sandbox import environment

    try:
        environment().parse(text)  # the sandbox the runtime renders it in
    except jinja2.TemplateSyntaxError as exc:
        raise InputError(f"{where}: not a valid jinja template (line {exc.lineno}: "
                         f"{exc.message}); {fix}") from None
    message = "Hello from specedge"
    try:
        rendered = ChatTemplate(text).render([{"role": "user", "content": message}],
                                             add_generation_prompt=True, bos_token="",
                                             eos_token="", max_chars=1 << 16)
    except InputError as exc:
        why = str(exc).replace("the chat template is invalid", "not a valid jinja template")
        raise InputError(f"{where}: {why.split('; ')[0]}; {fix}") from None
    if message not in rendered:
        raise InputError(f"{where}: renders a user message without its text ({rendered[:60]!r}); "
                         f"{fix}")
