"""The exit codes of ``rlplug train`` (and the other commands), and the exceptions that stop a run.

=====  ==========================================================================================
code   meaning
=====  ==========================================================================================
0      finished: the last step (or ``trainer.max_wall_time_s``) was reached, validated, saved, exported
1      an unexpected error (a traceback is printed); the last complete checkpoint is intact
2      bad input: the config, data, model path or checkpoint is wrong; the message says what to do.
       Nothing was trained
3      stopped: ``trainer.max_consecutive_bad_steps`` optimizer steps in a row had a non-finite loss
       or gradient; the last good checkpoint is intact
4      stopped: ``trainer.max_consecutive_bad_steps`` steps in a row had no usable reward (every
       response's reward function raised, timed out or returned NaN/None); the message gives the
       first error
5      stopped by an alert rule with ``action: stop`` (``trainer.alerts``) after saving the checkpoint
       of the step; the message names the rule and the value; rerun the same command to resume
74     stopped: the file system ran out of space while writing a checkpoint; the partial save was
       removed, the previous checkpoint is intact and ``latest`` names it; the message gives the
       space needed and free; free space, then rerun the same command to resume (``EX_IOERR``)
75     stopped by SIGTERM or SIGINT after finishing the step and saving a checkpoint; rerun the same
       command to resume (``EX_TEMPFAIL``: "try again later", so a scheduler can requeue the job)
130    interrupted by a second SIGINT/SIGTERM: stopped at once, without saving the step in progress
=====  ==========================================================================================
"""

from __future__ import annotations

import enum

__all__ = ["ExitCode", "TrainingStopped", "RewardFailuresStopped", "AlertStopped", "DiskFullStopped"]


class ExitCode(enum.IntEnum):
    """The process exit codes (the table in this module's docstring and in README.md)."""

    FINISHED = 0
    ERROR = 1
    BAD_INPUT = 2
    NON_FINITE = 3
    REWARD_FAILURES = 4
    ALERT_STOP = 5
    NO_SPACE = 74
    STOPPED_BY_SIGNAL = 75
    INTERRUPTED = 130


class TrainingStopped(RuntimeError):
    """Training stopped on purpose (e.g. too many consecutive non-finite steps); the message says why.

    ``exit_code`` is the process exit code ``rlplug train`` ends with (:class:`ExitCode`)."""

    exit_code: int = ExitCode.NON_FINITE


class RewardFailuresStopped(TrainingStopped):
    """``trainer.max_consecutive_bad_steps`` steps in a row in which every reward failed."""

    exit_code: int = ExitCode.REWARD_FAILURES


class AlertStopped(TrainingStopped):
    """A ``trainer.alerts`` rule with ``action: stop`` fired; the checkpoint of the step is saved
    (:mod:`rlplug.run.alerts`)."""

    exit_code: int = ExitCode.ALERT_STOP


class DiskFullStopped(TrainingStopped):
    """A checkpoint could not be written: no space left on the device (``ENOSPC``) or over the disk
    quota (``EDQUOT``); the partial save is removed and the previous checkpoint stays the latest
    (:meth:`rlplug.run.checkpoint.CheckpointManager.save`)."""

    exit_code: int = ExitCode.NO_SPACE
