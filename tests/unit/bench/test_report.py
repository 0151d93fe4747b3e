"""The benchmark's report: medians, spreads, anchors and ratios, the table text and the JSON document (no
sandboxes: rows are built by hand)."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest

from bench import report
from bench.__main__ import FIGURES, default_figures, parse_args
from bench.figures import ANCHORS, GOALS
from bench.registry import figure, figures
from bench.report import Anchor, Row

STOP = Anchor(2.2, "2.2 s", "resize guide: sbx stop --wait")


def test_row_median_spread_and_ratio() -> None:
    r = Row("resize", "sbx stop --wait", "s", [0.9, 0.6, 2.0, 0.8, 0.5], STOP)
    assert (r.n, r.median, r.min, r.max) == (5, 0.8, 0.5, 2.0)
    assert r.ratio == pytest.approx(0.8 / 2.2)
    assert report.fmt_ratio(r.ratio) == "0.36×"
    assert report.fmt_spread(r) == "500.0–2000.0 ms"  # the median is below 1 s: the spread is in ms too
    r = Row("resize", "sbx stop --wait", "s", [0.9, 1.1, 2.0, 1.0, 0.5], STOP)
    assert (r.median, report.fmt_spread(r)) == (1.0, "0.50–2.00 s")


def test_even_count_median_is_the_mean_of_the_middle_two() -> None:
    assert Row("x", "x", "s", [1.0, 2.0, 3.0, 10.0]).median == 2.5


def test_row_without_anchor_has_no_ratio() -> None:
    r = Row("exec", "exec true", "s", [0.03])
    assert r.ratio is None and report.fmt_ratio(r.ratio) == "—"


def test_zero_anchor_gives_no_ratio() -> None:
    assert Row("x", "x", "ms", [1.0], Anchor(0.0, "0 ms", "nowhere")).ratio is None


def test_row_from_stats() -> None:
    r = Row("disk", "disk reflink at 20 GiB", "ms", stats=(8.0, 4.0, 10.0, 5),
            anchor=Anchor(7.0, "7.0 ms", "the 1 GiB row"))
    assert (r.n, r.median, r.min, r.max, r.samples) == (5, 8.0, 4.0, 10.0, [])
    assert r.ratio == pytest.approx(8 / 7)
    assert report.fmt_spread(r) == "4.0–10.0 ms"


def test_bad_rows_are_refused() -> None:
    with pytest.raises(ValueError, match="unit"):
        Row("x", "x", "minutes", [1.0])
    with pytest.raises(ValueError, match="no samples"):
        Row("x", "x", "s", [])


@pytest.mark.parametrize(("value", "unit", "text"), [
    (2.2, "s", "2.20 s"), (18.605, "s", "18.61 s"), (0.0312, "s", "31.2 ms"), (8.14, "ms", "8.1 ms"),
    (1.0, "s", "1.00 s"), (120.0, "count", "120"), (9.27, "MiB", "9.3 MiB"), (0.4213, "load", "0.42"),
])
def test_fmt_time(value: float, unit: str, text: str) -> None:
    assert report.fmt_time(value, unit) == text


def test_density_rows_are_formatted_in_their_own_units() -> None:
    r = Row("density", "host memory used per idle sandbox", "MiB", [8.04, 9.5, 12.0])
    assert (report.fmt_time(r.median, r.unit), report.fmt_spread(r)) == ("9.5 MiB", "8.0 MiB–12.0 MiB")
    assert report.fmt_spread(Row("density", "count", "count", [20.0])) == "20–20"


def test_host_memory_used_is_read_from_meminfo() -> None:
    from bench.density import host_memory_used_mib

    assert 0 < host_memory_used_mib() < 1 << 24  # MiB: more than nothing, less than 16 TiB


def test_spread_of_a_row_above_one_second_is_in_seconds() -> None:
    assert report.fmt_spread(Row("x", "x", "s", [2.01, 2.4, 2.2])) == "2.01–2.40 s"


def test_reduced_rows_are_starred() -> None:
    fewer = Row("grow", "grow loop", "s", [12.0, 13.0], requested=5)
    full = Row("grow", "grow loop", "s", [12.0] * 5, requested=5)
    assert (report.fmt_n(fewer), report.fmt_n(full), report.fmt_n(Row("x", "x", "s", [1.0]))) == ("2*", "5", "1")
    assert fewer.reduced and not full.reduced


def test_table_text() -> None:
    rows = [
        Row("resize", "sbx stop --wait (small)", "s", [0.6, 0.7, 0.65], STOP),
        Row("grow", "grow loop end to end", "s", [12.0, 13.0], ANCHORS["grow"], "task sleeps 8 s", requested=5),
        Row("exec", "exec true (SDK)", "s", [0.031, 0.05, 0.04]),
    ]
    text = report.render(rows, title="sbx bench")
    lines = text.splitlines()
    assert lines[0].startswith("sbx bench")
    header = next(line for line in lines if "figure" in line)
    for col in ("ours (median)", "spread (min–max)", "seed anchor", "ours/anchor", "note"):
        assert col in header
    stop = next(line for line in lines if "sbx stop --wait (small)" in line)
    assert "650.0 ms" in stop and "600.0–700.0 ms" in stop and "2.2 s" in stop and "0.30×" in stop
    grow = next(line for line in lines if "grow loop end to end" in line)
    assert "12.50 s" in grow and " 2* " in grow and "18.6 s" in grow and "0.67×" in grow and "task sleeps 8 s" in grow
    exec_ = next(line for line in lines if "exec true (SDK)" in line)
    assert "40.0 ms" in exec_ and exec_.count("—") == 2  # no anchor, no ratio
    assert "* fewer runs than --repeats 5" in text
    assert "anchors: resize guide: sbx stop --wait; resize guide: time ./grow.sh" in text


def test_json_document_round_trips(tmp_path) -> None:  # type: ignore[no-untyped-def]
    rows = [Row("resize", "sbx stop --wait", "s", [0.6, 0.7], STOP, "cold"),
            Row("disk", "disk reflink at 1 GiB", "ms", stats=(0.3, 0.2, 0.4, 5))]
    started = datetime(2026, 11, 29, 10, 0, 0, tzinfo=UTC)
    finished = datetime(2026, 11, 29, 10, 7, 30, tzinfo=UTC)
    doc = report.document(rows, started=started, finished=finished, options={"repeats": 5},
                          host={"cpus": 2}, errors=[{"figure": "grow", "error": "boom"}],
                          figure_seconds={"resize": 12.345})
    path = report.write_json(doc, tmp_path / "results", when=started)
    assert path.name == "20261129T100000Z.json"
    again = report.write_json(doc, tmp_path / "results", when=started)
    assert again.name == "20261129T100000Z-1.json"
    got = json.loads(path.read_text())
    assert (got["schema"], got["started"], got["finished"], got["duration_s"]) == (
        1, "2026-11-29T10:00:00+00:00", "2026-11-29T10:07:30+00:00", 450.0)
    assert got["errors"] == [{"figure": "grow", "error": "boom"}]
    assert got["figure_seconds"] == {"resize": 12.3}
    stop, disk = got["rows"]
    assert stop == {"figure": "resize", "name": "sbx stop --wait", "unit": "s", "n": 2, "median": 0.65,
                    "min": 0.6, "max": 0.7, "samples": [0.6, 0.7],
                    "anchor": {"value": 2.2, "text": "2.2 s", "source": "resize guide: sbx stop --wait"},
                    "ratio": 0.295, "requested": None, "note": "cold"}
    assert (disk["n"], disk["median"], disk["samples"], disk["anchor"], disk["ratio"]) == (5, 0.3, [], None, None)


def test_anchors_match_the_seed_guides() -> None:
    assert {k: a.value for k, a in ANCHORS.items()} == {
        "stop": 2.2, "resume": 3.4, "resize": 5.6, "fork_same": 1.9, "fork_cli": 3.4, "grow": 18.6}


def test_goals_are_issue_13s() -> None:
    assert {k: a.value for k, a in GOALS.items()} == {"exec": 0.010, "cli": 0.120, "resume128": 0.35}


def test_options() -> None:
    a = parse_args([])
    assert (a.repeats, a.only, a.json) == (5, None, False)
    a = parse_args(["--only", "fork, grow", "--repeats", "2", "--json"])
    assert (a.only, a.repeats, a.json) == (["fork", "grow"], 2, True)
    assert list(FIGURES) == ["create", "exec", "ws128", "ws1g", "resize", "fork", "disk", "grow", "egress",
                             "density", "template", "forkmem", "migrate", "migrate-tls", "migclient", "remote",
                             "xresume", "xresume-tls", "images", "classes"]
    assert default_figures() == ["create", "exec", "ws128", "ws1g", "resize", "fork", "disk", "grow",
                                 "egress", "template", "forkmem", "images", "classes"]
    # density, migrate(+client, +tls), remote, xresume(+tls): opt-in
    a = parse_args(["--only", "density", "--density-max", "20", "--density-idle", "5"])
    assert (a.only, a.density_max, a.density_idle) == (["density"], 20, 5.0)
    assert (parse_args([]).density_max, parse_args([]).density_idle) == (300, 60.0)


@pytest.mark.parametrize("argv", [["--only", "nope"], ["--only", ","], ["--repeats", "0"], ["--disk-fill", "2"],
                                  ["--density-max", "0"], ["--density-idle", "-1"]])
def test_bad_options_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_figures_declare_where_they_run() -> None:
    assert {n for n, f in FIGURES.items() if f.opt_in} == {"density", "migrate", "migrate-tls", "migclient", "remote",
                                                           "xresume", "xresume-tls"}
    assert {n for n, f in FIGURES.items() if not f.needs_server} == {"disk", "migrate", "migrate-tls", "migclient",
                                                                     "xresume", "xresume-tls"}
    assert FIGURES["create"].run.__module__ == "bench.figures" and FIGURES["xresume"].run.__module__ == "bench.xresume"


def test_a_figure_name_or_place_is_taken_once() -> None:
    def fig_other(ctx):  # type: ignore[no-untyped-def]
        return []

    with pytest.raises(ValueError, match="'create'.*clashes with 'create'"):
        figure("create", order=999)(fig_other)
    with pytest.raises(ValueError, match="order 10.*clashes with 'create'"):
        figure("other", order=10)(fig_other)
    again = FIGURES["grow"]
    assert figure("grow", order=again.order)(again.run) is again.run  # the same function again: no clash
    assert list(figures()) == list(FIGURES)  # nothing was added by the refused ones
