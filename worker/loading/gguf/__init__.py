"""GGUF import: a llama.cpp model file (`--model PATH.gguf`, an Ollama blob, or the
packaged SmolLM2 behind `demo`) becomes an mlx-lm model directory in the state directory,
converted once in the worker process (never on the supervisor's event loop) and found
again by the file's hash.

- `reader`: the file, through the `gguf` package (metadata, dequantized tensors);
- `families`: config and tensor names per architecture, llama.cpp's layout changes undone;
- `tokenizer`: the tokenizer and chat template rebuilt from the file's fields;
- `convert`: the conversion, its cache key and marker, `--gguf-dtype` and `--quantize`.
"""

from protocol.model_ref import is_gguf
from worker.loading.gguf.convert import DTYPES, QUANTIZE, Options, cache_dir, ensure, sha256
from worker.loading.gguf.reader import GGUFError

__all__ = ["DTYPES", "QUANTIZE", "GGUFError", "Options", "cache_dir", "ensure", "is_gguf",
           "sha256"]
