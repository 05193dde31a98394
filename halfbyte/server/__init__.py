"""The OpenAI-compatible HTTP server (`halfbyte serve`)."""

from __future__ import annotations

from halfbyte.server.app import create_app, run_server

__all__ = ["create_app", "run_server"]
