"""Every torch encoder: importing this module registers them all in the type table (``gpu_encode``)."""

from forge.quant.torch_codecs import iq2, iq4, kquants, legacy  # noqa: F401
