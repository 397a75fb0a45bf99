"""The compact PyTorch runtime that loads and validates gguf-forge outputs."""
