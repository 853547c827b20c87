"""The example configs that ship inside the package: `plait demo` runs one, `plait init` copies one.

They are the repository's `configs/*.toml`, installed as package data of `plait.configs` and read
with `importlib.resources`, so a pip user in an empty folder has them too:

    plait init                 # writes ./tiny.toml, a starter to edit
    plait init demo my.toml    # the demo's config, under a name of your own
    plait train tiny.toml --nproc-per-node 2
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from plait.core.errors import PlaitError

if TYPE_CHECKING:
    from importlib.abc import Traversable

DEFAULT_STARTER = "tiny"


def _folder() -> Traversable:
    # NOTE: through `plait` (a regular package) rather than `plait.configs` (a folder of data
    # with no __init__.py): in an editable install `plait` maps to the repository root.
    return resources.files("plait").joinpath("configs")


def starter_names() -> list[str]:
    """The shipped configs' names (file names without `.toml`), sorted."""
    return sorted(
        entry.name.removesuffix(".toml")
        for entry in _folder().iterdir()
        if entry.is_file() and entry.name.endswith(".toml")
    )


def _entry(name: str) -> Traversable:
    names = starter_names()
    if name not in names:
        raise PlaitError(f"no example config named {name!r}; choose one of: {', '.join(names)}")
    return _folder().joinpath(f"{name}.toml")


def starter_text(name: str) -> str:
    """The TOML of the shipped config `name`; `PlaitError` naming the choices otherwise."""
    return _entry(name).read_text(encoding="utf-8")


@contextlib.contextmanager
def starter_path(name: str) -> Iterator[Path]:
    """A file system path of the shipped config `name` while the context is open (a zipped
    install extracts it to a temporary file)."""
    with resources.as_file(_entry(name)) as path:
        yield path


def write_starter(name: str, destination: Path) -> Path:
    """Copy the shipped config `name` to `destination` (a file, or a folder to hold
    `NAME.toml`); never overwrites: `PlaitError` when the file exists."""
    text = starter_text(name)
    if destination.is_dir():
        destination = destination / f"{name}.toml"
    if destination.exists():
        raise PlaitError(f"{destination} already exists; not overwriting it (choose another path)")
    header = (
        f"# A starter config from `plait init {name}`: edit it, check it with\n"
        f"# `plait config validate {destination.name} --nproc-per-node 2`, then\n"
        f"# `plait train {destination.name} --nproc-per-node 2`.\n"
    )
    destination.parent.mkdir(parents=True, exist_ok=True)
    with destination.open("x", encoding="utf-8") as out:  # "x": refuse a file made meanwhile
        out.write(header + text)
    return destination
