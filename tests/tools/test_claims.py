"""The claims table of docs/BENCHMARKS.md and the results table of README.md state only what
their JSONs give: tools/write_claims.py --check fails on a figure that differs from its JSON and
on a cited run whose JSON records no commit, date or command."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))

from dynapipe_ext.report import claims  # noqa: E402


def check(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "tools/write_claims.py", "--check", "--root", str(root)],
                          cwd=ROOT, text=True, capture_output=True, timeout=120)


@pytest.fixture
def copy_of_docs(tmp_path):
    """README.md, docs/BENCHMARKS.md and every cited JSON, copied."""
    (tmp_path / "docs").mkdir()
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    shutil.copy(ROOT / "docs" / "BENCHMARKS.md", tmp_path / "docs" / "BENCHMARKS.md")
    for name in claims.cited_files():
        shutil.copy(ROOT / "docs" / name, tmp_path / "docs" / name)
    return tmp_path


def test_the_committed_tables_are_what_the_jsons_give():
    result = check(ROOT)
    assert result.returncode == 0, result.stderr


def test_a_figure_its_json_does_not_give_fails_the_check(copy_of_docs):
    path = copy_of_docs / "docs" / "bench_planner.json"
    doc = json.loads(path.read_text())
    row = claims.pick(doc["rows"], model="gpt", tokens=65536, max_len=4096, stages=4,
                      strategy="dynamic")
    row["plan_cpu_ms"] += 10.0          # the JSON now says 10 ms more than the tables
    path.write_text(json.dumps(doc))
    result = check(copy_of_docs)
    assert result.returncode == 1
    assert "docs/BENCHMARKS.md: a table differs" in result.stderr
    assert "README.md: a table differs" in result.stderr


def test_a_cited_run_without_provenance_fails_the_check(copy_of_docs):
    path = copy_of_docs / "docs" / "bench_flextp_loss.json"
    doc = json.loads(path.read_text())
    del doc["meta"]["commit"]
    path.write_text(json.dumps(doc))
    result = check(copy_of_docs)
    assert result.returncode == 1
    assert "docs/bench_flextp_loss.json: commit: not recorded" in result.stderr


def test_every_row_cites_a_json_and_every_question_row_is_a_claim():
    assert all(c.sources for c in claims.CLAIMS)
    docs = {name: json.loads((ROOT / "docs" / name).read_text())
            for name in claims.cited_files()}
    table = claims.claims_table(docs).splitlines()[2:]
    assert len(table) == len(claims.CLAIMS)
    assert all(".json](" in line for line in table)
    results = claims.results_table(docs).splitlines()[2:]
    assert len(results) == sum(1 for c in claims.CLAIMS if c.question)


def row(strategy, tps, rounds, enc=1.0, dec=None):
    return {"model": "t5", "max_len": 2048, "strategy": strategy, "tokens_per_s": tps,
            "tokens_per_s_by_round": dict(enumerate(rounds)), "packing_algorithm": "lpfhp",
            "padding_efficiency_enc": enc, "padding_efficiency_dec": dec}


def test_dynamic_is_set_against_the_faster_packing_round_by_round():
    """Dataset-level packing (median 120) beats per-batch packing (100): dynamic's ratios are
    taken against it, round by round: 1.2, 0.9, 1.0 -> median 1.00x, spread 0.90-1.20."""
    rows = [row("packing+segment-attn", 100.0, [90.0, 100.0, 110.0], 0.84, 0.66),
            row("packing+window", 120.0, [100.0, 200.0, 120.0], 0.995, 0.991),
            row("dynamic", 130.0, [120.0, 180.0, 120.0], 0.999, 0.995)]
    docs = {"bench_padding_free.json": {"rows": rows, "settings": {"rounds": 3}}}
    assert claims.best_packing(rows, "t5", 2048)["strategy"] == "packing+window"
    text = claims.vs_best_packing(docs, "t5")
    assert text.startswith("1.00x (0.90-1.20) at max length 2048")
    assert "packing at its best was packing+window (lpfhp)" in text
    # both fill >= 0.99 of their slots: the planner's own gain is the same ratio
    assert claims.equal_padding(docs, "t5").startswith("2048: 1.00x (0.90-1.20) vs packing+window")
    rows[1]["padding_efficiency_dec"] = 0.90       # the window's decoder slots no longer full
    assert claims.equal_padding(docs, "t5") == ("2048: not equal (best packing fills 0.900, "
                                                "dynamic 0.995)")
