"""Quant types: registry (types.py) and codecs (codecs/*, each module registers its types)."""

import importlib
import pkgutil

from forge.quant import codecs as _codecs

for _mod in pkgutil.iter_modules(_codecs.__path__):
    importlib.import_module(f"{_codecs.__name__}.{_mod.name}")
