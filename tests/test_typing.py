"""The package type-checks: the public API under --strict, everything else under pyproject's
[tool.mypy] settings (py.typed promises users that the annotations hold)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _mypy(*args: str) -> None:
    r = subprocess.run([sys.executable, "-m", "mypy", *args], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_mypy_strict_on_the_public_modules() -> None:
    _mypy("--strict", "--follow-imports=silent", "halfbyte/api.py", "halfbyte/async_llm.py", "halfbyte/server",
          "halfbyte/sampling_params.py")


def test_mypy_on_the_whole_package() -> None:
    _mypy()  # files and settings from pyproject.toml
