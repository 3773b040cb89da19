import os

# Tests never reach a model hub: every checkpoint is made here with random weights.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Every load reads its file (a test of the loader tests the loader, not a cached model), and
# nothing is written to the user's cache; tests of the cache turn it on in a folder of theirs.
os.environ["CBATCH_FILE_CACHE"] = "0"


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


# Without a GPU, Triton kernels run in its CPU interpreter; the variable must be set before
# triton.jit decorates anything.
if not _has_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from cbatch.devices import auto_dtype as _REAL_AUTO_DTYPE  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _float32_when_auto():
    """``dtype="auto"`` (LLM's, Engine's and the CLI's default) picks bfloat16 on a CPU that
    computes in it and float16 on CUDA; tests compare against float32 references, so in them
    "auto" means float32 on every machine, except in tests of the rule itself (marked
    ``real_auto_dtype``: _real_auto_dtype_when_marked).  Patched for the whole session, so that
    module- and session-scoped fixtures, which build their engines before any function-scoped
    fixture runs, get float32 too (on a CPU with native bf16 they once got bfloat16).  Other
    processes (servers, Ray replicas) get the real rule: tests name their dtype there."""
    import cbatch.devices

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cbatch.devices, "auto_dtype", lambda device: "float32")
        yield


@pytest.fixture(autouse=True)
def _real_auto_dtype_when_marked(request, monkeypatch):
    if request.node.get_closest_marker("real_auto_dtype") is not None:
        import cbatch.devices

        monkeypatch.setattr(cbatch.devices, "auto_dtype", _REAL_AUTO_DTYPE)


TINY = dict(vocab_size=512, n_positions=256, n_embd=64, n_layer=2, n_head=4,
            bos_token_id=511, eos_token_id=511)


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory):
    """A tiny GPT-2 with random weights, saved by transformers as model.safetensors."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(**TINY)
    model = transformers.GPT2LMHeadModel(config).eval()
    path = tmp_path_factory.mktemp("tiny-gpt2")
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_hf_model(tiny_hf_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.GPT2LMHeadModel.from_pretrained(
        tiny_hf_dir, attn_implementation="eager", dtype=torch.float32).eval()
