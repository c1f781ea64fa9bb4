"""Benchmarks (not tests). The emulated device's toy stages live with the tests' support code
(``tests/support/emulated.py``): put that folder on the path for every bench module and for
the ranks they spawn (forkserver children inherit sys.path)."""

import sys
from pathlib import Path

_TESTS = str(Path(__file__).resolve().parent.parent / "tests")
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)
