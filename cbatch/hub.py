"""Where a model's files are: a local directory as it is, or a Hugging Face hub id's files
fetched (or found in the cache) by huggingface_hub; or a local GGUF file.  The loader, the
tokenizer and the server all find a checkpoint through :func:`resolve_checkpoint_dir`, and a
GGUF file through :func:`find_gguf_file`; it imports no torch."""

from __future__ import annotations

from pathlib import Path

CHECKPOINT_FILES = ("config.json", "*.safetensors", "model.safetensors.index.json",
                    "pytorch_model.bin", "generation_config.json")
# a directory holding any of these is a Hugging Face checkpoint, whatever .gguf it holds too
HF_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
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
    except Exception as e:  # offline, unknown repo, gated repo, not a repo id
        raise FileNotFoundError(f"could not load {name_or_path!r}: {_why(e)}") from e


def find_gguf_file(name_or_path: str) -> Path | None:
    """The GGUF file a model name stands for: a path ending in ``.gguf``, or a local directory
    holding one ``.gguf`` and no Hugging Face weights; None for any other name.  A ``.gguf``
    path that is not a file, or a directory holding several ``.gguf`` files, is an error that
    names them."""
    path = Path(name_or_path)
    if path.suffix == ".gguf" and not path.is_dir():
        if not path.is_file():
            raise FileNotFoundError(f"no GGUF file at {path}")
        return path
    if not path.is_dir() or any((path / name).is_file() for name in HF_WEIGHT_FILES):
        return None
    files = sorted(p for p in path.glob("*.gguf") if p.is_file())
    if len(files) > 1:
        names = ", ".join(p.name for p in files)
        raise ValueError(f"{path} holds {len(files)} GGUF files ({names}); name the one to "
                         "load (its path)")
    return files[0] if files else None


def _why(error: Exception) -> str:
    """One sentence for a hub id huggingface_hub could not fetch (its own messages run to
    several lines and name its internals)."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (GatedRepoError, HFValidationError,
                                        LocalEntryNotFoundError, RepositoryNotFoundError)

    if isinstance(error, HFValidationError):
        return "it is neither a local directory nor a valid hub id (owner/name)"
    local = "it is not a local directory, and "
    if isinstance(error, LocalEntryNotFoundError):
        hub = ("the Hugging Face hub is off here (HF_HUB_OFFLINE is set)"
               if constants.HF_HUB_OFFLINE else "the Hugging Face hub could not be reached")
        return local + hub + " and the local cache holds no copy of it"
    if isinstance(error, GatedRepoError):
        return local + ("it is a gated repo on the Hugging Face hub: accept its terms on "
                        "huggingface.co, then log in (hf auth login)")
    if isinstance(error, RepositoryNotFoundError):
        return local + ("the Hugging Face hub has no such repo (or it is private: log in "
                        "with hf auth login)")
    first_line = (str(error).strip().splitlines() or [""])[0]
    return local + f"fetching it from the Hugging Face hub failed ({type(error).__name__}: " \
        f"{first_line})"
