"""The breakdown section's accounting (no server): per-request rows, per-load means, the report and the plot."""

from bench import breakdown
from bench.run import parse_args


def _timing(**hops):
    return {hop: hops.get(hop) for hop in breakdown.HOPS}


def test_rows_keep_unmeasured_hops_and_the_unattributed_rest():
    row = breakdown.request_row(_timing(tokenize=0.01, prefill=0.2, decode=0.5), wall_s=1.0, first_byte_s=0.3)
    assert row["queue"] is None and abs(row["hops_sum_s"] - 0.71) < 1e-9
    assert abs(row[breakdown.UNATTRIBUTED] - 0.29) < 1e-9
    assert breakdown.request_row(_timing(decode=2.0), wall_s=1.0, first_byte_s=None)[breakdown.UNATTRIBUTED] == 0.0


def test_summary_report_and_plot(tmp_path):
    rows = [breakdown.request_row(_timing(tokenize=t, decode=1.0), wall_s=2.0, first_byte_s=0.5) for t in (0.1, 0.3)]
    summary = breakdown.summarize(rows)
    assert abs(summary["tokenize"] - 0.2) < 1e-9 and summary["queue"] is None and summary["requests"] == 2
    results = {"meta": {"command": "specserve bench --section breakdown --quick", "started": "now", "elapsed_s": 1},
               "engines": [{"engine": "native", "config": "configs/local.yaml", "unmeasured": ["queue"],
                            "loads": {"1": {"summary": summary, "requests": rows}}}], "notes": ["a note"]}
    plot = breakdown.plot_breakdown(results, tmp_path)
    text = breakdown.report_markdown(results, plot)
    assert "| 1 | 2 | 0.200 | - |" in text and "Not measured on this engine: queue" in text
    assert plot is None or (tmp_path / plot).is_file()


def test_the_cli_knows_the_section():
    assert parse_args(["--section", "breakdown", "--quick"]).section == "breakdown"
