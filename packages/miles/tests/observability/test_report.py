"""`miles report`: every section is on the page, and one with nothing to show says why."""

from __future__ import annotations

import re

from miles.cli.main import main
from miles.utils.observability.report_html import SECTIONS
from miles.utils.tracking import Tracker


def test_a_bare_run_gets_every_section_each_saying_what_is_missing(tmp_path, capsys):
    tracker = Tracker(tmp_path / "run", run_config={"lr": 0.001})
    tracker.log({"rollout/reward_mean": 0.5, "time/step_s": 2.0, "time/train_s": 1.5,
                 "time/generate_s": 0.25, "startup/total_s": 9.0}, step=0)  # fmt: skip
    tracker.close()
    assert main(["report", str(tmp_path / "run")]) == 0
    page = (tmp_path / "run" / "report.html").read_text()
    assert capsys.readouterr().out.strip() == str(tmp_path / "run" / "report.html")
    assert re.findall(r'<section id="([\w-]+)">', page) == [key for key, _ in SECTIONS]
    assert "data:image/png;base64," in page  # the reward curve, embedded
    assert "<td>0.25</td>" in page and "<td>0.25</td><td>1.5</td>" in page  # the time split
    for missing in ("memory was not recorded: run with --memory-snapshot-dir",
                    "no held-out evaluation", "no profile: run with --profile-target",
                    "no failure.log"):  # fmt: skip
        assert missing in page
    assert "<script" not in page and "http://" not in page.replace("https://ui.perfetto.dev", "")


def test_a_directory_without_a_run_is_a_one_line_error(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert (
        "has no metrics.jsonl; pass the --output-dir of a miles train run"
        in capsys.readouterr().err
    )
