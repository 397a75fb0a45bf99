"""gguf-forge: quantize, calibrate and lay out Mixture-of-Experts models as GGUF files."""

__version__ = "0.1.0"
