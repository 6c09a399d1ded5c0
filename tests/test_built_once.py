"""tests/built_once.py: a value built by the first caller of a pytest run, read by the rest."""

from __future__ import annotations

import pytest
from built_once import built_once


def test_the_second_caller_reads_what_the_first_built(tmp_path_factory):
    calls = []

    def build(folder):
        calls.append(folder)
        (folder / "state.txt").write_text("trained")
        return {"folder": folder, "loss": 1.5}

    first = built_once(tmp_path_factory, "probe", build)
    again = built_once(tmp_path_factory, "probe", build)
    assert first == again and len(calls) == 1
    assert (again["folder"] / "state.txt").read_text() == "trained"


def test_a_failed_build_leaves_nothing_and_is_tried_again(tmp_path_factory):
    def broken(folder):
        raise RuntimeError("no")

    with pytest.raises(RuntimeError):
        built_once(tmp_path_factory, "probe-broken", broken)
    assert built_once(tmp_path_factory, "probe-broken", lambda folder: 7) == 7
