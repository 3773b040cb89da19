"""GGUF files (llama.cpp's format): ``cbatch.load_model("model.gguf")``, ``LLM("model.gguf")``,
``cbatch serve model.gguf``.

- :mod:`~cbatch.models.gguf.reader`: the file, memory-mapped, its header read by
  :mod:`~cbatch.models.gguf.header`; its architecture and tensor types checked
  (:class:`GGUFFile`)
- :mod:`~cbatch.models.gguf.blocks`: the block-quantized types unpacked
  (:class:`UnpackedBlocks`, :func:`unpack`) and dequantized bitwise as gguf-py does
  (:func:`dequantize_tensor`); the layouts in ``legacy_quants`` and ``k_quants``
- :mod:`~cbatch.models.gguf.config`: the metadata as a model config
- :mod:`~cbatch.models.gguf.names`: GGUF tensor names and layouts as Hugging Face's
- :mod:`~cbatch.models.gguf.loader`: the model (:func:`load_gguf_model`)

The tokenizer and chat template a file carries are read by :mod:`cbatch.tokenizer` and the
server's ``chat_utils``.  Importing this package imports neither ``gguf`` nor the loader.
"""

from cbatch.models.gguf.blocks import (BLOCK_TYPES, FLOAT_TYPES, SUPPORTED_TYPES,
                                       UnpackedBlocks, dequantize_tensor, unpack)

__all__ = ["BLOCK_TYPES", "FLOAT_TYPES", "SUPPORTED_TYPES", "UnpackedBlocks",
           "dequantize_tensor", "unpack"]
