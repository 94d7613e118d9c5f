"""The exit codes are one table: ``rlplug.base.exit_codes.ExitCode``, its module docstring and README.md."""

from __future__ import annotations

import re
from pathlib import Path

import rlplug.base.exit_codes as exit_codes
from rlplug.base.exit_codes import ExitCode
from rlplug.cli import main

README = Path(__file__).resolve().parent.parent / "README.md"


def test_the_readme_and_the_docstring_list_every_exit_code_and_no_other():
    text = README.read_text()
    section = text[text.index("### Exit codes") :]
    section = section[: section.index("\n## ")]
    readme_codes = {int(m) for m in re.findall(r"^\| (\d+) \|", section, flags=re.M)}
    doc_codes = {int(m) for m in re.findall(r"^(\d+)\s{2,}", exit_codes.__doc__ or "", flags=re.M)}
    assert readme_codes == doc_codes == {int(c) for c in ExitCode}
    assert len(set(ExitCode)) == len(ExitCode.__members__)  # no two names share a code


def test_a_config_error_exits_2_before_anything_trains(capsys):
    assert main(["train", "algorithm=no_such_algorithm"]) == ExitCode.BAD_INPUT == 2
    assert "Config error" in capsys.readouterr().err
