"""A plugin manager for a plugin's tests: the built-ins and the plugins under test."""

from __future__ import annotations

from typing import Any

from plait.core.plugins import Plugins, plugin_object


def plugins_with(plugin: object = None, *, autoload: bool = False) -> Plugins:
    """A plugin manager with the built-ins and `plugin` registered: a module or object, a
    `(name, plugin)` pair, or a list of either; `None` registers nothing extra."""
    extra: list[tuple[str, object]] = []
    for item in _as_list(plugin):
        name, obj = item if isinstance(item, tuple) else (_name_of(item), item)
        extra.append((name, plugin_object(obj)))
    return Plugins.create(autoload=autoload, extra=extra)


def _as_list(plugin: object) -> list[Any]:
    if plugin is None:
        return []
    return list(plugin) if isinstance(plugin, list) else [plugin]


def _name_of(plugin: object) -> str:
    name = getattr(plugin, "__name__", None) or type(plugin).__name__
    return name.rsplit(".", 1)[-1]
