"""One registry per extension point: the names a config key accepts and what each name stands for.

Every extension point (data set kinds, backbones, heads, norms, loss terms, export formats) keeps one
`Registry`, in a module that imports no heavy package (torch, cv2, albumentations), so the config schema,
the command lines' --help and the docs can read the names without building anything. Entries refer to
their builders by a "package.module:attribute" string that `load_object` imports only when something is
built; a user's own entry may hold the callable itself.

This module uses the standard library only: `syncseg.model`, `syncseg.data` and the engine all import it.
"""
from __future__ import annotations

import difflib
import importlib
from typing import Any, Generic, Iterator, TypeVar

Entry = TypeVar("Entry")


def load_object(target: Any) -> Any:
    """The object a "package.module:attribute" string names (imported now); any other value as it is."""
    if not isinstance(target, str):
        return target
    module_name, separator, attribute = target.partition(":")
    if not separator or not module_name or not attribute:
        raise ValueError(f"{target!r} is not a 'package.module:attribute' reference")
    return getattr(importlib.import_module(module_name), attribute)


class Registry(Generic[Entry]):
    """Name -> entry for the config key `key` (e.g. "data.dataset"), in registration order.

    A family (`register_family`) accepts every `<prefix><name>` with a non-empty name, e.g. the backbones'
    `timm:<name>`, whose name the family's builder checks. `get` and `check` raise ValueError naming the
    key, the value, every registered name and the closest one.
    """

    def __init__(self, key: str) -> None:
        self.key = key
        self._entries: dict[str, Entry] = {}
        self._families: dict[str, tuple[Entry, str]] = {}  # prefix -> (entry, what its names mean)

    def register(self, name: str, entry: Entry, *, replace: bool = False) -> Entry:
        """Add `name`; ValueError if it is taken (unless `replace`) or looks like a family's name."""
        if not name or not isinstance(name, str):
            raise ValueError(f"{self.key}: a registered name must be a non-empty string, not {name!r}")
        if name in self._entries and not replace:
            raise ValueError(f"{self.key}: '{name}' is already registered; pass replace=True to replace it")
        if self._family_of(name) is not None:
            raise ValueError(f"{self.key}: '{name}' starts with the prefix of a family of names")
        self._entries[name] = entry
        return entry

    def register_family(self, prefix: str, entry: Entry, *, meaning: str) -> Entry:
        """Accept every `<prefix><name>` (non-empty name) as `entry`; `meaning` says what the names are."""
        self._families[prefix] = (entry, meaning)
        return entry

    def unregister(self, name: str) -> None:
        """Remove `name` (a test's or a plugin's own entry); KeyError if it is not registered."""
        del self._entries[name]

    def names(self) -> tuple[str, ...]:
        """The registered names, in registration order (families not included)."""
        return tuple(self._entries)

    def _family_of(self, name: str) -> str | None:
        return next((prefix for prefix in self._families if name.startswith(prefix) and name != prefix), None)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and (name in self._entries or self._family_of(name) is not None)

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def items(self) -> list[tuple[str, Entry]]:
        return list(self._entries.items())

    def describe(self) -> str:
        """The accepted values as a --help text or an error lists them: "a, b, or timm:<name> (...)"."""
        text = ", ".join(self._entries)
        for prefix, (_, meaning) in self._families.items():
            text += f", or {prefix}<name> ({meaning})"
        return text

    def suggestion(self, name: Any) -> str:
        """"; did you mean 'x'?" naming the registered name closest to `name`, or "" when none is close."""
        closest = difflib.get_close_matches(str(name), list(self._entries), n=1)
        return f"; did you mean '{closest[0]}'?" if closest else ""

    def unknown(self, name: Any) -> str:
        """The message for a value that is not registered: the key, the value, the choices, the closest."""
        return f"{self.key}={name!r} is not one of {self.describe()}{self.suggestion(name)}"

    def check(self, name: Any) -> None:
        """ValueError (`unknown`'s message) when `name` is neither registered nor in a family."""
        if name not in self:
            raise ValueError(self.unknown(name))

    def get(self, name: str) -> Entry:
        """The entry of `name` (a family's entry for `<prefix><name>`); ValueError when there is none."""
        self.check(name)
        if name in self._entries:
            return self._entries[name]
        return self._families[self._family_of(name)][0]
