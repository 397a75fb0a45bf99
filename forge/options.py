"""Command-line option checks, in one place: every command validates its numbers here, before any work.

Each check raises ForgeError naming the option and what it accepts, so the user gets one ``error:`` line.
"""

from __future__ import annotations

import math

from forge.errors import ForgeError

# Seeds become numpy/torch seeds: both take 0 .. 2**63 - 1 (numpy rejects negatives, torch larger values).
MAX_SEED = 2**63 - 1


def require_int(option: str, value: int | None, lo: int | None = None, hi: int | None = None) -> None:
    """``value`` (when given) lies in [lo, hi]."""
    if value is None:
        return
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise ForgeError(f"{option} must be {_span(lo, hi)}, not {value}")


def require_float(
    option: str,
    value: float | None,
    lo: float | None = None,
    hi: float | None = None,
    lo_open: bool = False,
) -> None:
    """``value`` (when given) is finite and lies in [lo, hi] (or (lo, hi] with ``lo_open``)."""
    if value is None:
        return
    if not math.isfinite(value):
        raise ForgeError(f"{option} must be a finite number, not {value}")
    below = lo is not None and (value <= lo if lo_open else value < lo)
    if below or (hi is not None and value > hi):
        raise ForgeError(f"{option} must be {_span(lo, hi, lo_open)}, not {_num(value)}")


def require_seed(option: str, value: int | None) -> None:
    require_int(option, value, 0, MAX_SEED)


def require_choice(option: str, value: str, choices: tuple[str, ...] | list[str]) -> None:
    if value not in choices:
        raise ForgeError(f"{option} must be one of {', '.join(choices)}, not {value!r}")


def require_context(option: str, value: int | None, model_context: int | None, lo: int = 2) -> None:
    """A context length of at least ``lo`` tokens and at most the model's trained context."""
    require_int(option, value, lo)
    if value is not None and model_context and value > model_context:
        raise ForgeError(f"{option} {value} exceeds the model's context length {model_context}")


def _span(lo: float | None, hi: float | None, lo_open: bool = False) -> str:
    if lo is not None and hi is not None:
        return f"in {'(' if lo_open else '['}{_num(lo)}, {_num(hi)}]"
    if lo is not None:
        return f"{'>' if lo_open else '>='} {_num(lo)}"
    return f"<= {_num(hi)}"


def _num(v: float | None) -> str:
    return f"{v:,}" if isinstance(v, int) else f"{v:g}"
