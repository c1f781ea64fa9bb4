"""One-line hints on stderr for settings that work but are probably not what the user wants.

Every command that takes a pipeline size and a microbatch count calls ``warn_p_exceeds_m``
(``simulate``, ``select``, ``compare``, ``demo``; ``train`` may too).
"""

from __future__ import annotations

import sys


def p_exceeds_m_hint(p: int | None, m: int | None) -> str | None:
    """The hint for p > m (more pipeline ranks than microbatches), else None."""
    if p is None or m is None or p <= m:
        return None
    return (f"hint: p={p} > m={m}: most ranks idle most of the step; use m >= p "
            "(Megatron needs m >= p for interleaved)")


def warn_p_exceeds_m(p: int | None, m: int | None, stream=None) -> bool:
    """Print the p > m hint on ``stream`` (default stderr); True when it printed."""
    text = p_exceeds_m_hint(p, m)
    if text is None:
        return False
    print(text, file=stream or sys.stderr, flush=True)
    return True
