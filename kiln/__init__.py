"""kiln: compile a Hugging Face checkpoint into an artefact, then serve the artefact."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kiln.version import __version__

if TYPE_CHECKING:
    from kiln.runtime.engine import Engine

__all__ = ["Engine", "__version__"]


def __getattr__(name: str) -> Any:
    # Importing `kiln` stays cheap (the CLI's --help should not load torch); Engine is
    # resolved on first use.
    if name == "Engine":
        from kiln.runtime.engine import Engine

        return Engine
    raise AttributeError(f"module 'kiln' has no attribute {name!r}")
