"""Parameter names as the unsharded model has them, whatever wrappers a transform added.

Parameter initialisation (values drawn from the name), checkpoints and weight exports all key a
parameter by this name, so wrapping a block (activation checkpointing, `torch.compile`, FSDP1)
changes neither how it is initialised nor where it is saved.
"""

from __future__ import annotations

# Wrappers that insert a name component (activation checkpointing, torch.compile, FSDP1).
WRAPPER_COMPONENTS = frozenset({"_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module"})


def normalised_name(name: str) -> str:
    """`name` without the components wrapper modules add (e.g. `_checkpoint_wrapped_module`)."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_COMPONENTS)
