"""The embedded model's cache: concurrent first conversions (selfrl.model._rename_into_place)."""

from __future__ import annotations

import pytest

from selfrl.model import ModelLoadError, _rename_into_place


def _finished_copy(path, marker):
    path.mkdir()
    (path / "config.json").write_text(marker)
    (path / "model.safetensors").write_text(marker)


def test_first_conversion_is_renamed_into_place(tmp_path):
    tmp, target = tmp_path / ".convert-a", tmp_path / "smollm2"
    _finished_copy(tmp, "a")
    _rename_into_place(tmp, target)
    assert (target / "config.json").read_text() == "a"
    assert not tmp.exists()


def test_a_concurrent_winner_is_kept_and_the_loser_does_not_raise(tmp_path):
    # Two first runs started together: process b finishes second. Its rename onto the winner's
    # non-empty directory fails with ENOTEMPTY; it must use the winner's copy, not crash.
    winner, loser, target = tmp_path / ".convert-a", tmp_path / ".convert-b", tmp_path / "smollm2"
    _finished_copy(winner, "a")
    _finished_copy(loser, "b")
    _rename_into_place(winner, target)
    _rename_into_place(loser, target)
    assert (target / "config.json").read_text() == "a"
    assert sorted(p.name for p in target.iterdir()) == ["config.json", "model.safetensors"]


def test_a_foreign_directory_at_the_cache_path_is_a_clear_error(tmp_path):
    tmp, target = tmp_path / ".convert-a", tmp_path / "smollm2"
    _finished_copy(tmp, "a")
    target.mkdir()
    (target / "notes.txt").write_text("not a model")
    with pytest.raises(ModelLoadError, match="not a converted model.*SELFRL_CACHE"):
        _rename_into_place(tmp, target)
    assert (target / "notes.txt").read_text() == "not a model"  # nothing of the user's is lost


def test_an_empty_directory_at_the_cache_path_is_replaced(tmp_path):
    tmp, target = tmp_path / ".convert-a", tmp_path / "smollm2"
    _finished_copy(tmp, "a")
    target.mkdir()
    _rename_into_place(tmp, target)
    assert (target / "config.json").read_text() == "a"
