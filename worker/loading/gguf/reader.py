"""One GGUF file, read with the `gguf` package (llama.cpp's own reader): metadata by key,
tensors dequantized to float32 numpy arrays in PyTorch's (row-major, outer first) order.

Why a wrapper: the converter asks three kinds of questions, "what is `llama.block_count`",
"which tensors are there" and "give me this tensor as floats", and every answer must turn a
malformed or unsupported file into a `GGUFError` naming what is wrong (the quant type, the
key), never an exception from deep inside numpy that a client would see as a 500.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


class GGUFError(Exception):
    """A GGUF that cannot be converted; the message names why and is safe to show."""


class GGUFFile:
    def __init__(self, path: str | Path):
        import gguf

        self.path = Path(path)
        try:
            self._reader = gguf.GGUFReader(self.path)
        except (ValueError, OSError, IndexError) as e:  # bad magic, version, truncated file
            raise GGUFError(f"{self.path.name} is not a readable GGUF file: {e}") from None
        self.arch = self.get("general.architecture")
        if not isinstance(self.arch, str):
            raise GGUFError(f"{self.path.name} names no general.architecture")
        self.tensors = {t.name: t for t in self._reader.tensors}

    # ---- metadata ----------------------------------------------------------------------

    def get(self, key: str, default=None):
        """The value under `key`: a str, int, float, bool or a list of them."""
        field = self._reader.get_field(key)
        if field is None:
            return default
        try:
            return field.contents()
        except UnicodeDecodeError:
            raise GGUFError(f"metadata {key} is not valid UTF-8") from None

    def arch_get(self, key: str, default=None):
        """`{architecture}.{key}`, e.g. arch_get("block_count")."""
        return self.get(f"{self.arch}.{key}", default)

    def require(self, key: str):
        value = self.arch_get(key)
        if value is None:
            raise GGUFError(f"{self.path.name} lacks the metadata {self.arch}.{key}")
        return value

    # ---- tensors -----------------------------------------------------------------------

    def quant_types(self) -> set[str]:
        return {t.tensor_type.name for t in self.tensors.values()}

    def check_quant_types(self) -> None:
        """Fail before any work if a tensor's type has no dequantizer in `gguf`."""
        import gguf.quants

        seen = {}
        for t in self.tensors.values():
            seen.setdefault(t.tensor_type, t)
        unsupported = []
        for qtype, t in seen.items():
            try:  # one row is enough to know the type is understood
                gguf.quants.dequantize(t.data[:1], qtype)
            except NotImplementedError:
                unsupported.append(qtype.name)
        if unsupported:
            raise GGUFError(f"{self.path.name}: cannot dequantize tensor type(s) "
                            f"{', '.join(sorted(unsupported))} (the gguf package has no "
                            f"dequantizer for them)")

    def tensor(self, name: str) -> np.ndarray:
        """`name` as float32, shaped as PyTorch (and mlx-lm) hold it: GGUF lists the
        dimensions innermost first."""
        import gguf.quants

        t = self.tensors[name]
        try:
            values = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise GGUFError(f"{self.path.name}: cannot dequantize {name} of type "
                            f"{t.tensor_type.name}") from None
        shape = tuple(int(d) for d in reversed(t.shape))
        return np.asarray(values, dtype=np.float32).reshape(shape)

    def n_elements(self) -> int:
        return sum(int(t.n_elements) for t in self.tensors.values())
