"""The package sets torch's OpenMP wait policy to PASSIVE when it is imported before
torch (spinning OpenMP workers slow the host gather up to 40x on the H200), and never
overrides a user's setting or changes it after torch has loaded."""

from __future__ import annotations

import os
import subprocess
import sys

from helpers.files import REPO

PY = str(REPO / "python")


def _policy(code: str, **env: str) -> str:
    e = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    e.update(env)
    e["PYTHONPATH"] = PY + os.pathsep + e.get("PYTHONPATH", "")
    out = subprocess.run(
        [sys.executable, "-c", code + "; import os; print(os.environ.get('OMP_WAIT_POLICY', 'unset'))"],
        env=e,
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip().splitlines()[-1]


def test_package_first_sets_passive() -> None:
    assert _policy("import engram_trt") == "PASSIVE"


def test_user_setting_wins() -> None:
    assert _policy("import engram_trt", OMP_WAIT_POLICY="ACTIVE") == "ACTIVE"


def test_torch_first_is_left_alone() -> None:
    assert _policy("import torch, engram_trt") == "unset"
