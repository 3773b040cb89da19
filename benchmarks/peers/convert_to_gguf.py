"""llama.cpp's ``convert_hf_to_gguf.py`` on a checkpoint of ``make_random_checkpoint.py`` whose
architecture llama.cpp reads as a BPE model (Qwen2, Qwen3): their converter would hash the
random tokenizer's pre-tokenizer, find none it knows, and stop, and a BPE vocabulary without
merges does not load in llama-server.  Here the vocabulary is written as llama.cpp writes a
Llama checkpoint's (``_set_vocab_llama_hf``), as it does for ``random:llama-3.2-1b``; the
weights and the graph are the converter's own.  The benchmark sends token ids, so no text is
ever split by this vocabulary.  Run it in a venv with llama.cpp's requirements, with its
checkout and its gguf-py on the path, and the converter's own arguments:

    PYTHONPATH=$P/llama.cpp/gguf-py:$P/llama.cpp $P/ov/bin/python \\
        benchmarks/peers/convert_to_gguf.py $P/qwen2.5-0.5b --outtype f16 \\
        --outfile $P/gguf-models/qwen2.5-0.5b-f16.gguf
"""
import sys

import conversion.base
import convert_hf_to_gguf

# a BPE model's set_vocab falls back to _set_vocab_gpt2 where no tokenizer.model exists
conversion.base.TextModel._set_vocab_gpt2 = conversion.base.TextModel._set_vocab_llama_hf

if __name__ == "__main__":
    sys.argv[0] = convert_hf_to_gguf.__file__
    convert_hf_to_gguf.main()
