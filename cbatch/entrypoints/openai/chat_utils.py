"""Chat templates (vLLM's ``chat_utils``): found in a checkpoint (``chat_template.jinja`` or
``tokenizer_config.json``; a GGUF file's ``tokenizer.chat_template``) with its special tokens,
read from ``--chat-template`` and checked before any model loads, and compiled in a sandbox,
as transformers renders them."""

from __future__ import annotations

import json
from pathlib import Path


def load_chat_template(checkpoint_dir: Path | None) -> str | None:
    """The Jinja chat template a checkpoint ships (``chat_template.jinja``, or the
    ``chat_template`` field of ``tokenizer_config.json``), else None."""
    if checkpoint_dir is None:
        return None
    if (checkpoint_dir / "chat_template.jinja").is_file():
        return (checkpoint_dir / "chat_template.jinja").read_text()
    config = checkpoint_dir / "tokenizer_config.json"
    if config.is_file():
        template = json.loads(config.read_text()).get("chat_template")
        return template if isinstance(template, str) else None
    return None


def load_special_tokens(checkpoint_dir: Path | None) -> dict[str, str]:
    """The ``bos_token`` and ``eos_token`` strings of ``tokenizer_config.json`` (templates
    write them into the prompt: Llama's begins with ``{{ bos_token }}``); "" when absent."""
    config = None if checkpoint_dir is None else checkpoint_dir / "tokenizer_config.json"
    raw = json.loads(config.read_text()) if config is not None and config.is_file() else {}
    tokens = {}
    for name in ("bos_token", "eos_token"):
        value = raw.get(name) or ""
        tokens[name] = value.get("content", "") if isinstance(value, dict) else value
    return tokens


def load_gguf_chat_template(path: Path, tokenizer=None) -> tuple[str | None, dict[str, str]]:
    """The chat template a GGUF file carries (``tokenizer.chat_template``, else None), and the
    spellings of its BOS and EOS tokens ("" when it names none), as :func:`load_chat_template`
    and :func:`load_special_tokens` read a checkpoint's.  Taken from ``tokenizer`` when it was
    built from the same file (the engine's): the file is not parsed again."""
    if tokenizer is not None and getattr(tokenizer, "gguf_file", None) == Path(path):
        return tokenizer.chat_template, dict(tokenizer.special_tokens)
    from cbatch.models.gguf.reader import GGUFFile

    with GGUFFile(path) as f:
        template = f.get("tokenizer.chat_template", None)
        tokens = {name: f.token(f.get(f"tokenizer.ggml.{name}_id", None)) or ""
                  for name in ("bos_token", "eos_token")}
    return template, tokens


def read_chat_template(value: str) -> str:
    """``--chat-template``: a file holding a Jinja template, or the template itself; checked
    (it must parse) before any model loads."""
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    path = Path(value)
    is_file = len(value) < 4096 and "\n" not in value and path.is_file()
    template = path.read_text() if is_file else value
    if not is_file and "{{" not in template and "{%" not in template:
        raise ValueError(f"chat template {value!r} is neither a file nor a Jinja template")
    try:
        ImmutableSandboxedEnvironment().parse(template)
    except TemplateSyntaxError as e:
        raise ValueError(f"chat template {value!r:.60} does not parse: {e}") from None
    return template


def _raise_template_error(message: str):
    from jinja2 import TemplateError

    raise TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # transformers' tojson (Jinja's own escapes <, > and & for HTML, which no prompt wants)
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def compile_chat_template(template: str):
    """A template ready to render, in a sandbox as transformers renders one (a template is
    data, not code), with transformers' ``raise_exception`` and ``tojson``."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    # templates refuse messages they cannot render with raise_exception(message)
    # (Llama-2 and Mistral's do, for roles out of order), as in transformers
    env.globals["raise_exception"] = _raise_template_error
    env.filters["tojson"] = _tojson
    return env.from_string(template)
