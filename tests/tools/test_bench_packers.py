"""tools/bench_packers.py: every packer's real / slots, per batch and windowed, on a real
preprocessed FLAN-like dataset, and its BENCHMARKS.md section."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from dynapipe_ext.report.packing_table import PACKERS, packed_rows

REPO = Path(__file__).resolve().parent.parent.parent


def run_tool(*args):
    subprocess.run([sys.executable, *args], cwd=REPO, check=True, capture_output=True,
                   text=True, timeout=120)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    d = tmp_path_factory.mktemp("flan")
    run_tool("tools/make_flan_sample.py", "--output", str(d / "flan.jsonl"),
             "--num-samples", "400", "--seed", "3")
    run_tool("tools/train_tokenizer.py", "--input", str(d / "flan.jsonl"),
             "--model-prefix", str(d / "sp"), "--vocab-size", "800")
    run_tool("tools/preprocess_flan.py", "--input", str(d / "flan.jsonl"), "--output-prefix",
             str(d / "flan"), "--tokenizer-type", "SentencePieceTokenizer",
             "--tokenizer-model", str(d / "sp.model"), "--no-progress")
    return str(d / "flan")


def test_every_packer_per_batch_and_windowed(dataset, tmp_path):
    doc = tmp_path / "BENCH.md"
    doc.write_text("# Benchmarks\n\n## Other\nkept\n")
    timed = tmp_path / "timed.json"
    timed.write_text(json.dumps({
        "settings": {"packing_algorithm": "lpfhp", "train_args": ["--packing-window", "400"],
                     "num_layers": 4, "hidden_size": 64, "pp": 2,
                     "tokens_per_global_batch": 2048, "warmup_iters": 1, "iters": 3},
        "load_average_end": [3.0, 2.0, 1.0],
        "rows": [{"model": "gpt", "max_len": 512, "strategy": "packing+segment-attn",
                  "tokens_per_s": 1234.5, "iteration_s": [1.0, 1.5, 1.2],
                  "padding_efficiency_enc": 0.97, "padding_efficiency_dec": None,
                  "shapes": ["4*1x512", "2*2x512", "3*1x512"], "real_tokens": 4000,
                  "executor_cpu_s_per_rank": [1.0, 2.0]}]}))
    run_tool("tools/bench_packers.py", "--data-path", dataset, "--max-lengths", "512",
             "--tokens-per-global-batch", "2048", "8192", "--json-out",
             str(tmp_path / "out.json"), "--markdown", str(doc), "--timed", str(timed))
    result = json.loads((tmp_path / "out.json").read_text())
    rows = {(r["model"], r["packer"]): r for r in result["rows"]}
    assert sorted(rows) == sorted((m, p) for m in ("gpt", "t5") for p in PACKERS)
    for r in rows.values():
        for cell in list(r["per_batch"].values()) + [r["windowed"]]:
            assert all(0 < x <= 1 for x in cell["real_over_slots"])
            assert len(cell["real_over_slots"]) == (1 if r["model"] == "gpt" else 2)
    # the whole dataset packed ahead beats next-fit on each small batch
    gpt = lambda p, mode: (rows["gpt", p]["windowed"] if mode == "windowed"      # noqa: E731
                           else rows["gpt", p]["per_batch"]["2048"])["real_over_slots"][0]
    assert gpt("lpfhp", "windowed") > gpt("nextfit", "per batch") + 0.05
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\n## Other\nkept\n")
    assert "<!-- packers:start -->" in text and "| gpt | 512 | nnlshp |" in text
    assert "| t5 | 512 | lpfhp |" in text and "- GPT 512: best windowed `" in text
    assert "| gpt | 512 | lpfhp | - | - | - | - | 1,234 | 2,000 | 4 4 3 | 0.97 |" in text


def test_packed_rows_of_a_shapes_summary():
    assert packed_rows("5*1x2048") == 5
    assert packed_rows("2*2x512/128 1x512/128") == 5
    assert packed_rows("1x8 1x9 1x10 1x11 1x12 1x13 (+2 more)") is None
