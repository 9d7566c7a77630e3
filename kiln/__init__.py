"""kiln: compile a Hugging Face checkpoint into an artefact, then serve the artefact."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

from kiln.version import __version__

if TYPE_CHECKING:
    from kiln.runtime.engine import Engine

__all__ = ["Engine", "__version__"]


def _checkout_root_off_path() -> None:
    """Take a source checkout's root off `sys.path`.

    The repository keeps the design card's flat layout, so its root holds folders named like
    PyPI packages: `kernels/` is Hugging Face's `kernels` too, which transformers (5.25 on)
    imports when it is installed. `python -m ...` and `python -c` run from the checkout put
    that root first on the path, and `import kernels` would then find kiln's folder
    (installed as `kiln.kernels`; nothing imports it by its folder's name). A wheel install
    has no such root: site-packages holds no pyproject.toml.
    """
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if not os.path.isfile(os.path.join(root, "pyproject.toml")):
        return
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != root]


_checkout_root_off_path()


def __getattr__(name: str) -> Any:
    # Importing `kiln` stays cheap (the CLI's --help should not load torch); Engine is
    # resolved on first use.
    if name == "Engine":
        from kiln.runtime.engine import Engine

        return Engine
    raise AttributeError(f"module 'kiln' has no attribute {name!r}")
