"""The errors of the plugin system, in a leaf module so that any layer can raise or catch them.

:mod:`rlplug.contracts.registry` raises most of them and re-exports every one under the same name
(``rlplug.contracts.registry.PluginContractError`` is this module's class); :mod:`rlplug.contracts.kinds` raises
:class:`PluginContractError`. All derive from :class:`PluginError`.
"""

from __future__ import annotations


class PluginError(Exception):
    """Base class of plugin-system errors."""


class UnknownPluginError(PluginError, KeyError):
    """A plugin name was asked for that no loaded plugin registered.

    The message names the kind, suggests close matches, lists every available name with its
    distribution, and mentions plugins that failed to load.
    """

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class PluginConflictError(PluginError):
    """Two plugins registered the same name in one kind; the message names both distributions."""

    def __init__(self, message: str, first: str = "", second: str = "") -> None:
        super().__init__(message)
        self.first, self.second = first, second


class PluginContractError(PluginError, TypeError):
    """A selected plugin does not implement its kind's Protocol (:mod:`rlplug.contracts.kinds`).

    The message names the kind, the name, the distribution, and each missing, misnamed or
    wrongly-called member; ``problems`` lists them one by one.
    """

    def __init__(self, message: str, problems: list[str] | None = None) -> None:
        super().__init__(message)
        self.problems = list(problems or [])


class PluginLoadError(PluginError):
    """A plugin's entry point failed to import or register; raised when it is selected."""


class UnknownKindError(PluginError, ValueError):
    """A plugin kind that does not exist was asked for."""
