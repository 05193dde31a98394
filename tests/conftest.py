"""Shared fixtures. Kernel tests run Triton's interpreter where there is no GPU; the variable
must be set before triton is first imported, hence here."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    from halfbyte.io.default_model import ensure_default_model

    return ensure_default_model(fetch=True)
