"""The compact PyTorch runtime: loads GGUF files (quantized experts stay encoded) and runs the models."""
