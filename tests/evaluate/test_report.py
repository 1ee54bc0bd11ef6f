"""Reports: exact Markdown tables, JSON-lines round trip, and plots that write non-empty PNGs."""

import pytest

from specblock.evaluate.reporting.metrics import AUTOREGRESSIVE, OVERALL, Accumulator
from specblock.evaluate.reporting.report import (
    block_efficiency_table,
    markdown_report,
    plot_acceptance_at,
    plot_block_efficiency,
    read_jsonl,
    records,
    select,
    speedup_table,
    write_jsonl,
    write_markdown,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run(accepts: dict[str, list[int]], K: int = 1, L: int = 3, temperature: float = 0.0) -> list[dict]:
    """Records of one configuration: chain steps per dataset, 1 s per generation; autoregressive on
    every dataset at 2 tokens/s."""
    acc = Accumulator()
    for dataset, steps in accepts.items():
        acc.add_generation(dataset, AUTOREGRESSIVE, tokens=4, seconds=2.0, target_calls=4)
        for a in steps:
            acc.add_iteration(dataset, "chain", accepted=a, emitted=a + 1, draft_len=L, drafter_calls=L)
        acc.add_generation(dataset, "chain", tokens=sum(steps) + len(steps), seconds=1.0)
    return records(acc, {"verifier": "chain", "K": K, "L": L, "temperature": temperature})


def test_records_carry_config_counts_and_metrics():
    rows = run({"a": [2, 0], "b": [3]})
    assert [(r["dataset"], r["method"]) for r in rows] == [
        ("a", AUTOREGRESSIVE),
        ("a", "chain"),
        ("b", AUTOREGRESSIVE),
        ("b", "chain"),
        (OVERALL, AUTOREGRESSIVE),
        (OVERALL, "chain"),
    ]
    (overall,) = select(rows, dataset=OVERALL, method="chain")
    assert overall["L"] == 3 and overall["counts"]["iterations"] == 3
    assert overall["metrics"]["tau"] == pytest.approx(5 / 3)
    assert overall["metrics"]["speedup"] == pytest.approx(4.0 / 2.0)  # 8 tok / 2 s over 8 tok / 4 s
    with pytest.raises(ValueError, match="clash"):
        records(Accumulator(), {"method": "x"})


def test_markdown_tables_exact():
    rows = run({"a": [2, 0], "b": [3]})
    assert block_efficiency_table(rows) == (
        "| dataset | autoregressive | chain |\n"
        "|---|---|---|\n"
        "| a | 1.00 (–) | 2.00 (1.00) |\n"
        "| b | 1.00 (–) | 4.00 (3.00) |\n"
        "| overall | 1.00 (–) | 2.67 (1.67) |\n"
    )
    assert speedup_table(rows) == (
        "| dataset | autoregressive | chain |\n"
        "|---|---|---|\n"
        "| a | 1.00x | 2.00x |\n"
        "| b | 1.00x | 2.00x |\n"
        "| overall | 1.00x | 2.00x |\n"
    )
    report = markdown_report(rows)
    assert report.startswith("### Block efficiency") and "### Speedup" in report


def test_table_refuses_two_configurations():
    with pytest.raises(ValueError, match="two records"):
        block_efficiency_table(run({"a": [1]}, L=2) + run({"a": [1]}, L=3))


def test_jsonl_and_markdown_round_trip(tmp_path):
    rows = run({"a": [2, 0], "b": [3]})
    write_jsonl(tmp_path / "eval" / "results.jsonl", rows)
    back = read_jsonl(tmp_path / "eval" / "results.jsonl")
    assert back == rows
    assert back[0]["metrics"]["tau"] is None  # undefined ratio written as null, not NaN
    write_markdown(tmp_path / "eval" / "results.md", rows)
    assert (tmp_path / "eval" / "results.md").read_text() == markdown_report(rows)
    assert sorted(p.name for p in (tmp_path / "eval").iterdir()) == ["results.jsonl", "results.md"]


def sweep() -> list[dict]:
    """K, L and temperature sweeps; each varies one axis with the others at their defaults."""
    rows = []
    for K in (1, 2, 4):
        rows += run({"a": [min(K, 3), 1]}, K=K)
    for L in (2, 4, 6):
        rows += run({"a": [L - 1, 1]}, L=L, K=8)
    for t in (0.5, 1.0):
        rows += run({"a": [1, 0]}, temperature=t, K=16)
    return rows


@pytest.mark.parametrize(
    "x, where", [("K", {"L": 3, "temperature": 0.0}), ("L", {"K": 8}), ("temperature", {"K": 16})]
)
def test_plot_block_efficiency_writes_png(tmp_path, x, where):
    path = tmp_path / f"block_efficiency_vs_{x}.png"
    plot_block_efficiency(select(sweep(), **where), x, path)
    assert path.read_bytes().startswith(PNG_MAGIC) and path.stat().st_size > 1000


def test_plot_block_efficiency_refuses_mixed_axes(tmp_path):
    with pytest.raises(ValueError, match="share a value of L"):
        plot_block_efficiency(sweep(), "L", tmp_path / "x.png")


def test_plot_acceptance_at_writes_png(tmp_path):
    rows = run({"a": [2, 0, 3], "b": [1]}) + [
        {**r, "method": "chain-long"} for r in run({"a": [5, 2], "b": [4]}, L=6) if r["method"] == "chain"
    ]
    path = tmp_path / "acceptance_at.png"
    plot_acceptance_at(rows, path)
    assert path.read_bytes().startswith(PNG_MAGIC) and path.stat().st_size > 1000
