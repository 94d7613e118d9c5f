"""rlplug-example-plugin: a minimal third-party rlplug plugin.

It registers, through the ``rlplug`` entry-point group (see ``pyproject.toml``):

* the reward function ``exact_match`` (kind ``reward_function``), and
* the advantage estimator ``median_baseline`` (kind ``advantage_estimator``).

Use them from a config once the package is installed::

    rlplug train algorithm=grpo algorithm.adv_estimator=median_baseline \
        reward.reward_fn_map.basic_arithmetic=exact_match
"""

from __future__ import annotations

from rlplug.plugin import hookimpl

from .advantage import median_baseline, median_baseline_advantage
from .rewards import exact_match

__version__ = "0.1.0"
__all__ = ["exact_match", "median_baseline", "median_baseline_advantage"]


@hookimpl
def register_reward_functions(register):
    register("exact_match", exact_match)


@hookimpl
def register_advantage_estimators(register):
    register("median_baseline", median_baseline)
