"""The version of rlplug, in a module of its own so that any layer can read it.

``pyproject.toml``'s ``[project] version`` is the same string; an installed distribution reports
it through ``importlib.metadata.version("rlplug")``. ``rlplug.__version__`` re-exports this value.
"""

from __future__ import annotations

__version__ = "0.1.0"
