"""support.shared_runs: a result computed once a session is read back by any later caller (in
the suite: another module on another xdist worker), whole; keys that cannot name a result
across processes are refused."""

import pytest

from support.shared_runs import SHARED_RUNS_ENV, computed_once


def test_a_result_is_computed_once_and_read_back_whole(tmp_path, monkeypatch):
    monkeypatch.setenv(SHARED_RUNS_ENV, str(tmp_path))
    calls = []

    def compute(value):
        calls.append(value)
        return {"losses": [value, value / 2], "rank": 0}

    first = computed_once(("run", 4, ("--pp", "2")), lambda: compute(1.5))
    again = computed_once(("run", 4, ("--pp", "2")), lambda: compute(9.0))
    other = computed_once(("run", 4, ("--pp", "4")), lambda: compute(2.0))
    assert calls == [1.5, 2.0]  # the second call with the first key read the stored result
    assert again == first == {"losses": [1.5, 0.75], "rank": 0} and again is not first
    assert other["losses"] == [2.0, 1.0]
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".pickle", ".pickle"]  # no partials


def test_without_a_session_folder_every_call_computes(monkeypatch):
    monkeypatch.delenv(SHARED_RUNS_ENV, raising=False)
    calls = []
    for _ in range(2):
        computed_once(("run",), lambda: calls.append(1))
    assert calls == [1, 1]


def test_a_key_naming_an_object_by_its_address_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv(SHARED_RUNS_ENV, str(tmp_path))
    with pytest.raises(ValueError, match="names an object by its memory address"):
        computed_once(("run", object()), lambda: 1)
    assert list(tmp_path.iterdir()) == []
