"""Every module here defines QuantType subclasses; importing forge.quant imports them all."""
