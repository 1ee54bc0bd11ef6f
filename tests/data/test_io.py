import pytest

from specblock.data.errors import BadInputError, RowPolicy
from specblock.data.io import atomic_path, write_json_atomic


def test_atomic_path_leaves_nothing_half_written_on_a_crash(tmp_path):
    target = tmp_path / "out.json"
    write_json_atomic(target, {"a": 1})
    with pytest.raises(KeyboardInterrupt):
        with atomic_path(target) as tmp:
            tmp.write_text("half")
            raise KeyboardInterrupt
    assert target.read_text().strip().startswith("{") and sorted(p.name for p in tmp_path.iterdir()) == [
        "out.json"
    ]


def test_atomic_path_replaces_a_folder(tmp_path):
    target = tmp_path / "shards"
    for value in ("one", "two"):
        with atomic_path(target) as tmp:
            tmp.mkdir()
            (tmp / "x.txt").write_text(value)
    assert (target / "x.txt").read_text() == "two" and len(list(tmp_path.iterdir())) == 1


def test_row_policy_errors_or_counts():
    err = BadInputError("f.json", 3, "conversations", "missing field")
    assert str(err) == "f.json, row 3, field 'conversations': missing field"
    with pytest.raises(BadInputError):
        RowPolicy("error").bad(err)
    policy = RowPolicy("skip")
    policy.bad(err)
    policy.bad(err)
    assert policy.total_skipped == 2 and "2 x missing field" in policy.summary()
    with pytest.raises(ValueError, match="on_bad_row"):
        RowPolicy("ignore")
