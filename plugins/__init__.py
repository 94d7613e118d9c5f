"""rlplug's packaged plugins.

Each module here is an independent plugin registered through the ``rlplug`` entry-point group
in ``pyproject.toml``, exactly like a third-party package; ``rlplug`` core never imports them by
name.
"""
