"""`[checkpoint_io]`: where and how often the training loop saves and resumes checkpoints,
declared by the plugin that saves them (`[checkpoint]` is activation checkpointing)::

    [checkpoint_io]
    dir = "/shared/ckpt/my-run"     # '' disables checkpoints
    every = 500                     # save every 500 optimizer steps; 0 = only at the end

The NaN/Inf guard's and fault injection's keys, once written here, load at their place in
`[resilience]` (`plait.core.config.MOVED_KEYS`).
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import Field

from plait.core.config import PlaitConfig, Section
from plait.core.hookspecs import hookimpl
from plait.core.records import ConfigSectionRecord

SECTION = "checkpoint_io"


class CheckpointIOConfig(Section):
    """`[checkpoint_io]` section."""

    dir: str = Field("", description="checkpoint root directory; '' disables checkpoints")
    every: int = Field(0, ge=0, description="save every N optimizer steps; 0 = only at the end")
    keep: int = Field(3, ge=0, description="keep the newest K checkpoints; 0 keeps all")
    async_save: bool = Field(True, description="write in a background thread after a host copy")
    resume: bool = Field(True, description="resume from the latest complete checkpoint in dir")
    save_final: bool = Field(True, description="save after the last step")
    init_from: str = Field(
        "", description="checkpoint whose model weights start a fresh run (e.g. an HF import)"
    )
    verify_checksums: bool = Field(True, description="check CRC-32s (not only sizes) on resume")


def checkpoint_io_config(config: PlaitConfig) -> CheckpointIOConfig:
    """The job's `[checkpoint_io]` section (defaults where the file has none)."""
    return config.section(SECTION, CheckpointIOConfig)


@hookimpl
def plait_register_config_sections() -> Sequence[ConfigSectionRecord]:
    return [
        ConfigSectionRecord(
            name=SECTION,
            config_cls=CheckpointIOConfig,
            description="checkpoint directory, interval, retention and resume",
        )
    ]
