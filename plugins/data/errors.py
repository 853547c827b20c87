"""The errors of plait's data pipeline, in one module every data module can import."""

from __future__ import annotations

from plait.core.errors import PlaitError


class DataError(PlaitError, ValueError):
    """Training data cannot be prepared or sampled as configured."""


class TokenFileError(DataError):
    """A token-file directory is missing, corrupt, truncated or inconsistent with its meta."""
