"""The GPU run's summary from pytest's JUnit XML (what tests/gpu/run_h200.sh prints and
writes as ``summary.json``): per module, how many tests passed, failed, errored and were
skipped, and the ids of those that did not pass.

    python tests/gpu/summary.py OUT/gpu.xml [OUT/summary.json]
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

OUTCOMES = ("passed", "failed", "error", "skipped")


def module_of(classname: str) -> str:
    """``tests.gpu.test_gemv`` / ``gpu.test_gemv.TestX`` -> ``test_gemv`` (the first
    dotted part naming a test module; else the whole class name)."""
    parts = classname.split(".")
    return next((p for p in parts if p.startswith("test_")), classname)


def outcome_of(case: ET.Element) -> str:
    tags = {child.tag for child in case}
    for tag, outcome in (("error", "error"), ("failure", "failed"), ("skipped", "skipped")):
        if tag in tags:
            return outcome
    return "passed"


def summarize(xml_path: str | Path) -> dict[str, dict]:
    """{module: {"passed": n, "failed": n, "error": n, "skipped": n, "not_passed": [ids]}}."""
    out: dict[str, dict] = {}
    for case in ET.parse(str(xml_path)).getroot().iter("testcase"):
        mod = out.setdefault(module_of(case.get("classname", "")), {**{o: 0 for o in OUTCOMES}, "not_passed": []})
        outcome = outcome_of(case)
        mod[outcome] += 1
        if outcome in ("failed", "error"):
            mod["not_passed"].append(f"{case.get('name')} ({outcome})")
    return dict(sorted(out.items()))


def lines(summary: dict[str, dict]) -> list[str]:
    rows = [f"{'module':<32} {'passed':>6} {'failed':>6} {'error':>6} {'skipped':>7}"]
    for name, m in summary.items():
        rows.append(f"{name:<32} {m['passed']:6d} {m['failed']:6d} {m['error']:6d} {m['skipped']:7d}")
        rows += [f"    not passed: {t}" for t in m["not_passed"]]
    total = {o: sum(m[o] for m in summary.values()) for o in OUTCOMES}
    rows.append(f"{'total':<32} {total['passed']:6d} {total['failed']:6d} {total['error']:6d} {total['skipped']:7d}")
    return rows


def main(argv: list[str]) -> int:
    summary = summarize(argv[0])
    print("\n".join(lines(summary)))
    if len(argv) > 1:
        Path(argv[1]).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
