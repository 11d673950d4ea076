"""C++ / CUDA hygiene of plugins/ and runtime/: every source carries the SPDX header, and is formatted
with the repository's .clang-format (TensorRT OSS's settings)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from helpers.files import REPO

SPDX = (
    "// SPDX-License-Identifier: Apache-2.0",
    "// SPDX-FileCopyrightText: Copyright (c) 2026 engram-trt contributors",
)
CLANG_FORMAT_VERSION = "23."  # the version the sources were formatted with (test extra: clang-format==23.1.5)


def plugin_sources() -> list[Path]:
    files = sorted(
        p for top in ("plugins", "runtime") for ext in ("h", "cuh", "cpp", "cu") for p in (REPO / top).rglob(f"*.{ext}")
    )
    assert len(files) >= 20, files  # the walk found the plugin tree
    return files


def test_every_plugin_source_starts_with_the_spdx_header() -> None:
    missing = [str(p.relative_to(REPO)) for p in plugin_sources() if tuple(p.read_text().splitlines()[:2]) != SPDX]
    assert not missing, f"no SPDX header: {missing}"
    for cmake in [
        REPO / "CMakeLists.txt",
        *sorted(p for top in ("plugins", "runtime") for p in (REPO / top).rglob("CMakeLists.txt")),
    ]:
        assert cmake.read_text().startswith("# SPDX-License-Identifier: Apache-2.0\n"), cmake


def test_plugin_sources_are_clang_formatted() -> None:
    exe = shutil.which("clang-format")
    if exe is None:
        pytest.skip("clang-format is not installed (pip install clang-format==23.1.5)")
    version = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout
    if f"version {CLANG_FORMAT_VERSION}" not in version:
        pytest.skip(f"clang-format {version.strip()} is not the {CLANG_FORMAT_VERSION}x the sources follow")
    unformatted = []
    for path in plugin_sources():
        out = subprocess.run(
            [exe, f"--style=file:{REPO / '.clang-format'}", str(path)], capture_output=True, text=True, check=True
        ).stdout
        if out != path.read_text():
            unformatted.append(str(path.relative_to(REPO)))
    assert not unformatted, f"run clang-format -i on: {unformatted}"
