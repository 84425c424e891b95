"""A table of named entries that modules fill as they are imported (speculative methods, exit kinds,
artifact loaders)."""
from __future__ import annotations


class Registry(dict):
    def __init__(self, what: str) -> None:
        super().__init__()
        self.what = what  # how an error names an entry

    def register(self, entry):
        self[entry.name] = entry
        return entry

    def find(self, name: str, spelled: str | None = None):
        """The entry `name`; an unknown one is a ValueError naming the option as `spelled`."""
        if name not in self:
            raise ValueError(f"unknown {spelled or self.what} {name!r} (choose from none, {', '.join(self)})")
        return self[name]
