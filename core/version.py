"""plait's version, in one place: the package's `plait.__version__`, the daemon's `Status`
reply and the ranks' telemetry resource all read it from here (pyproject.toml repeats it)."""

__version__ = "0.1.0"
