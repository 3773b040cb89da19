"""Where a model's files are: a local directory as it is, or a Hugging Face hub id's files
fetched (or found in the cache) by huggingface_hub.  The loader, the tokenizer and the server
all find a checkpoint through :func:`resolve_checkpoint_dir`; it imports no torch."""

from __future__ import annotations

from pathlib import Path

CHECKPOINT_FILES = ("config.json", "*.safetensors", "model.safetensors.index.json",
                    "pytorch_model.bin", "generation_config.json")
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "merges.txt", "tokenizer_config.json",
                   "chat_template.jinja")


def resolve_checkpoint_dir(name_or_path: str,
                           allow_patterns: tuple[str, ...] = CHECKPOINT_FILES + TOKENIZER_FILES
                           ) -> Path:
    """A local directory as it is, or a hub id's files matching ``allow_patterns``
    fetched (or found in the cache) by huggingface_hub."""
    path = Path(name_or_path)
    if path.is_dir():
        return path
    if path.exists() or name_or_path.startswith((".", "/")):
        raise FileNotFoundError(f"{name_or_path} is not a directory (one holding "
                                f"{', '.join(allow_patterns)})")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name_or_path, allow_patterns=list(allow_patterns)))
    except Exception as e:  # offline, unknown repo, no huggingface_hub
        raise FileNotFoundError(f"{name_or_path!r} is neither a local directory nor "
                                f"a reachable Hugging Face hub id ({type(e).__name__}: {e})"
                                ) from e
