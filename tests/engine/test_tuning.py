"""EngineTuning: the engine's performance knobs, validated as they are made."""

from __future__ import annotations

import pytest

from formcast.engine import EngineConfig
from formcast.engine.tuning import EngineTuning


@pytest.mark.parametrize("fields, match", [
    ({"premask_ema": 0}, "premask_ema must be in"),
    ({"premask_ema": 1.5}, "premask_ema must be in"),
    ({"premask_after": -0.1}, "premask_after must be >= 0"),
    ({"graph_copies": 1}, "graph_copies must be at least 2"),
    ({"commit_chore_rows": 0}, "commit_chore_rows must be positive"),
    ({"overlap_rows": -1}, "overlap_rows must be >= 0"),
    ({"picks_whole_row": 1}, "picks_whole_row must be a bool"),
    ({"few_masks": 2.5}, "few_masks must be an int"),
    ({"detok_chore_tokens": "32"}, "detok_chore_tokens must be a number"),
])
def test_out_of_range_knobs_are_value_errors(fields, match):
    with pytest.raises(ValueError, match=match):
        EngineTuning(**fields)


@pytest.mark.parametrize("specs, expected", [
    ([], {}),
    (["overlap_rows=1"], {"overlap_rows": 1}),
    (["detok_chore_tokens=None", "premask_after=2"], {"detok_chore_tokens": None,
                                                       "premask_after": 2}),
    (["uniform_rows=False"], {"uniform_rows": False}),
])
def test_command_line_specs_replace_fields(specs, expected):
    tuning = EngineTuning.parse(specs)
    for name, value in expected.items():
        assert getattr(tuning, name) == value
    untouched = {"graves_kept", "fold_norms"} - set(expected)
    for name in untouched:
        assert getattr(tuning, name) == getattr(EngineTuning(), name)


@pytest.mark.parametrize("spec, match", [
    ("no_such=1", "no field 'no_such'"),
    ("overlap_rows=lots", "not a Python literal"),
    ("overlap_rows=-3", "overlap_rows must be >= 0"),
])
def test_bad_command_line_specs_are_value_errors(spec, match):
    with pytest.raises(ValueError, match=match):
        EngineTuning.parse([spec])


@pytest.mark.parametrize("given, overlap", [
    (None, 128),
    ({"overlap_rows": 4}, 4),
    (EngineTuning(overlap_rows=9), 9),
])
def test_engine_config_takes_a_tuning_object_or_its_fields(given, overlap):
    config = EngineConfig() if given is None else EngineConfig(tuning=given)
    assert isinstance(config.tuning, EngineTuning)
    assert config.tuning.overlap_rows == overlap


def test_engine_config_refuses_another_kind_of_tuning():
    with pytest.raises(ValueError, match="tuning must be an EngineTuning"):
        EngineConfig(tuning=[("overlap_rows", 1)])
