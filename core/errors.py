"""Exceptions plait raises for bad input, so callers and the CLI can report them cleanly."""

from __future__ import annotations


class PlaitError(Exception):
    """Base class: a problem the user can fix, reported without a traceback by the CLI."""


class ConfigError(PlaitError):
    """A config file or override is invalid; the message names the field and what is allowed."""


class PluginError(PlaitError):
    """A plugin is missing, misbehaves or raised; the message names it and its distribution."""


class InertSelection(PluginError):
    """A plugin the config selects by name took over nothing where it could have
    (`plait.core.selection_check`)."""


class MeshError(PlaitError):
    """The parallel degrees do not fit the world size or the model."""


class ScheduleError(PlaitError):
    """A schedule's action list is invalid (unmatched send, backward before forward, deadlock)."""


class CheckpointError(PlaitError):
    """A checkpoint or a weight folder is missing, incomplete or corrupted, or cannot be applied."""
