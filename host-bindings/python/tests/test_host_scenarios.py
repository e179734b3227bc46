"""Every host scenario (conformance/hosts/*.json) replayed through the Python public API under
virtual time: the asyncio decorator and AsyncLeveeTransport always, the synchronous decorator
and LeveeTransport where the scenario allows it. The trace must match `expect` exactly."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from tests.hosts_runner import SCENARIOS, compare, load_generator, replay, scenario_files, sync_replayable

FILES = scenario_files()


def _load(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return data


def test_there_are_scenarios() -> None:
    assert len(FILES) >= 80


def test_scenarios_match_the_schema() -> None:
    schema = json.loads((SCENARIOS / "schema.json").read_text(encoding="utf-8"))
    validator = jsonschema.Draft202012Validator(schema)
    problems = [
        f"{p.name}: {'/'.join(map(str, e.path))}: {e.message}" for p in FILES for e in validator.iter_errors(_load(p))
    ]
    problems += [f"{p.name}: name must equal the file name" for p in FILES if _load(p)["name"] != p.stem]
    assert not problems, "\n".join(problems)


def test_scenario_files_are_the_generators() -> None:
    gen = load_generator()
    on_disk = {p.stem: _load(p) for p in FILES}
    for scn in gen.build():
        got = on_disk.pop(scn["name"], None)
        assert got is not None, f"{scn['name']}: not blessed"
        for c in got["calls"]:
            c.pop("expect", None)
        assert got == scn, f"{scn['name']}: the file's inputs differ from scenarios.py (bless again)"
    assert not on_disk, f"files with no scenario: {sorted(on_disk)}"


GEN = load_generator()


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_async_api(path: Path) -> None:
    scn = _load(path)
    traces = replay(scn)
    for k, (c, t) in enumerate(zip(scn["calls"], traces, strict=True)):
        diffs = compare(c["expect"], t)
        assert not diffs, f"call {k}: " + "; ".join(diffs)
    GEN.check_intent(scn, traces)  # the full trace, unchecked fields included, still meets the intent


def test_intents_refuse_wrong_traces() -> None:
    """An intent is not a formality: a trace whose results are all wrong fails nearly all of them."""
    refused = 0
    for path in FILES:
        scn = _load(path)
        wrong = [{**c["expect"], "result": {"value": "__wrong__"}} for c in scn["calls"]]
        try:
            GEN.check_intent(scn, wrong)
        except (AssertionError, KeyError):
            refused += 1
    assert refused >= 0.9 * len(FILES), f"only {refused} of {len(FILES)} intents look at the result"


SYNC = [p for p in FILES if sync_replayable(_load(p))]


@pytest.mark.parametrize("path", SYNC, ids=[p.stem for p in SYNC])
def test_sync_api(path: Path) -> None:
    scn = _load(path)
    for k, (c, t) in enumerate(zip(scn["calls"], replay(scn, sync=True), strict=True)):
        diffs = compare(c["expect"], t)
        assert not diffs, f"call {k}: " + "; ".join(diffs)
