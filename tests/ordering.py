"""The suite's files, longest first.

Under ``--dist loadfile`` each file runs whole on one xdist process, handed
out in collection order (the Makefile turns off xdist's own reordering, which
puts the files with the most tests first: the few long multi-node files then
started last and ran alone for minutes). Ordered by the time each took in a
measured run, the long ones start first and the short ones fill in behind.

``tests/durations.json`` holds those times (seconds per file, setup and
teardown included); a file missing from it counts as ``_UNKNOWN``. Refresh it
with ``make test-durations``: a run with ``--store-durations`` writes it anew.
"""
from __future__ import annotations

import json
import pathlib
from collections import defaultdict

import pytest

_FILE = pathlib.Path(__file__).with_name("durations.json")
_UNKNOWN = 10.0  # seconds: about a middling file's time
_taken: defaultdict[str, float] = defaultdict(float)  # seconds per file in this run


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--store-durations", action="store_true",
                     help=f"write each test file's total time into {_FILE.name} at the end (Dpex's ordering)")


def _file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def _known() -> dict[str, float]:
    return json.loads(_FILE.read_text()) if _FILE.exists() else {}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    known = _known()
    first_seen = {}
    for item in items:
        first_seen.setdefault(_file_of(item.nodeid), len(first_seen))
    # A stable sort: the tests of a file keep their order, files of equal cost theirs.
    items.sort(key=lambda item: (-known.get(_file_of(item.nodeid), _UNKNOWN), first_seen[_file_of(item.nodeid)]))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # In xdist's controller too: every worker's reports arrive there.
    _taken[_file_of(report.nodeid)] += report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    config = session.config
    if config.getoption("store_durations") and not hasattr(config, "workerinput") and _taken:
        # Merged: a run of some files keeps the others' times.
        merged = {**_known(), **{name: round(seconds, 1) for name, seconds in _taken.items()}}
        totals = dict(sorted(merged.items(), key=lambda kv: -kv[1]))
        _FILE.write_text(json.dumps(totals, indent=1) + "\n")
