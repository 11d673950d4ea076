"""The README's two commands are the project's contract: `.ci/run` runs exactly the
README's test command (a drift once left CI without a package the tests import)."""

from __future__ import annotations

import re

from helpers.files import REPO


def _readme_commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    section = text.split("## The two commands", 1)[1].split("\n## ", 1)[0]
    return [block.strip() for block in re.findall(r"```bash\n(.*?)```", section, flags=re.S)]


def test_ci_runs_the_readmes_test_command() -> None:
    setup, tests = _readme_commands()
    assert setup.endswith("engram-trt demo") and tests.endswith("python3 -m pytest -q")
    ci = [
        line
        for line in (REPO / ".ci" / "run").read_text().splitlines()
        if line and not line.startswith(("#", "set ", "cd ", "export "))
    ]
    assert ci == [tests]
