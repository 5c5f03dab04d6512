"""Worker output → the objects and chunks of chat and legacy completions."""
