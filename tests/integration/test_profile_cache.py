"""--cost-model profile: the run's own model is profiled on first use, cached under its key
(model, device, precision, TP) and reused later; a corrupt cache file is profiled again; with
several ranks rank 0's tensor-parallel group profiles and the others wait, and a failure is
the same error on every rank."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from dynapipe_ext.costs.cost_profile import (LayerTable, ProfiledCostModel, auto_grid,
                                       cached_profile, fill_rows_by_scaling, load_profile,
                                       profile_covers)
from dynapipe_ext.costs.model_spec import ENC_LAYER, GPT_LAYER
from megatron.planning import device_costs
from megatron.training.arguments import parse_args
from megatron.training.training import model_spec
from tests.multiproc import free_port, run_in_processes, single_process_world

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_tool(*args, timeout=120):
    """A tool as a command (`args` from its path on), from the repository root; fails the test
    on a non-zero exit."""
    subprocess.run([sys.executable, *map(str, args)], cwd=REPO, check=True, timeout=timeout)


def run_config(cache_dir, *extra, model="gpt"):
    lengths = (["--encoder-seq-length", "32", "--decoder-seq-length", "16"] if model == "t5"
               else ["--seq-length", "64"])
    return parse_args(model, ["--num-layers", "1", "--hidden-size", "32",
                              "--num-attention-heads", "2", "--train-iters", "1",
                              "--data-path", "unused", "--tokens-per-global-batch", "256",
                              "--cost-model", "profile", "--cost-model-cache-dir",
                              str(cache_dir), *lengths, *extra], has_cuda=False)


def spec_of(cfg):
    return model_spec(cfg, vocab_size=100)


# ---------------------------------------------------------------------------- grid and scaling

def test_auto_grid_covers_the_run_and_caps_measured_tokens():
    grid = auto_grid(max_seq_len=1000, max_dec_seq_len=200, max_tokens=4096)
    assert grid.seq_lens == (16, 64, 256, 1000) and grid.dec_seq_lens == (16, 64, 200)
    assert grid.rows == (1, 4, 16, 64, 256)          # 256 rows of 16 tokens fit 4096
    assert grid.measured({"rows": 1, "seq_len": 1000, "dec_seq_len": 200})
    assert grid.measured({"rows": 4, "seq_len": 1000}) is True
    assert grid.measured({"rows": 16, "seq_len": 256, "dec_seq_len": 64})   # 16 x 256 = cap
    assert not grid.measured({"rows": 16, "seq_len": 1000})
    assert not grid.measured({"rows": 16, "seq_len": 64, "dec_seq_len": 1000})
    assert auto_grid(8, 0, 64).seq_lens == (8,) and auto_grid(8, 0, 64).dec_seq_lens == (1,)


def test_rows_left_out_are_filled_by_scaling_and_rows_above_the_grid_scale():
    rows = np.array([1.0, 4.0, 16.0])
    measured = np.array([[2.0, 5.0], [6.0, np.nan], [np.nan, np.nan]])
    filled = fill_rows_by_scaling({"fwd_ms": measured}, rows)["fwd_ms"]
    np.testing.assert_allclose(filled, [[2, 5], [6, 20], [24, 80]])

    spec = spec_of(run_config("/unused"))
    fields = ("fwd_ms", "bwd_ms", "activation_bytes", "shared_bytes", "peak_bytes")
    table = LayerTable(("rows", "seq_len"), (rows, np.array([16.0, 64.0])),
                       {f: filled for f in fields})
    from dynapipe_ext.costs.cost_profile import CostProfile, profile_key
    profile = CostProfile(profile_key(spec, 1, "dev", "float32"),
                          {k: 1 for k in ("embedding", GPT_LAYER, "head")},
                          {k: 4 for k in ("embedding", GPT_LAYER, "head")},
                          {k: {"none": table} for k in ("embedding", GPT_LAYER, "head")},
                          {"device_memory_bytes": 2**30})
    plain = ProfiledCostModel(profile)
    scaled = ProfiledCostModel(profile, rows_above_grid="scale", below_grid="bound")
    assert plain.stage_costs(32, 64, 0, 1) is None
    at_top = scaled.stage_costs(16, 64, 0, 1)[0]
    above = scaled.stage_costs(32, 64, 0, 1)[0]
    assert above.fwd_ms == pytest.approx(2 * at_top.fwd_ms)
    assert above.activation_bytes == pytest.approx(2 * at_top.activation_bytes, rel=1e-9)
    assert scaled.stage_costs(1, 5, 0, 1)[0].fwd_ms == pytest.approx(3 * 2.0)  # bound below


# ---------------------------------------------------------------------------- keys

def test_dtype_tp_model_and_cache_dir_give_different_files(tmp_path):
    base = run_config(tmp_path)
    paths = {device_costs.profile_cache_path(cfg, spec_of(cfg)) for cfg in (
        base, run_config(tmp_path, "--bf16"),
        run_config(tmp_path, "--tensor-model-parallel-size", "2"),
        run_config(tmp_path, "--hidden-size", "64"),
        run_config(tmp_path, "--ffn-hidden-size", "64"))}
    assert len(paths) == 5 and all(p.parent == tmp_path for p in paths)
    assert device_costs.profile_cache_path(base, spec_of(base)) == \
        device_costs.profile_cache_path(run_config(tmp_path), spec_of(base))
    other = run_config(tmp_path / "elsewhere")
    assert device_costs.profile_cache_path(other, spec_of(other)).parent == tmp_path / "elsewhere"
    source = device_costs.cost_model_source(base, 1, spec=spec_of(base))
    assert source.kind == "profile" and source.path == str(
        device_costs.profile_cache_path(base, spec_of(base)))


def test_cache_dir_flag_needs_profile_mode(tmp_path):
    with pytest.raises(SystemExit):
        parse_args("gpt", ["--num-layers", "1", "--hidden-size", "32",
                           "--num-attention-heads", "2", "--train-iters", "1", "--data-path",
                           "x", "--cost-model-cache-dir", str(tmp_path)], has_cuda=False)


# ---------------------------------------------------------------------------- one rank

def test_first_run_profiles_second_reuses_corrupt_file_is_profiled_again(tmp_path,
                                                                        monkeypatch):
    cfg = run_config(tmp_path)
    spec = spec_of(cfg)
    said = []
    with single_process_world(seed=3):
        import torch
        before = torch.get_rng_state()
        path = device_costs.ensure_cost_profile(cfg, spec, 0, torch.device("cpu"), said.append)
        assert torch.equal(torch.get_rng_state(), before)   # training RNG untouched
    assert path.exists() and "profiling GPT" in said[0] and "wrote" in said[-1]
    profile = load_profile(path, expect_key=device_costs.run_profile_key(cfg, spec))
    assert profile.meta["made_by"] == "--cost-model profile"
    assert profile_covers(profile, 64, 0) and profile.modes() == ("none", "selective", "full")
    layer = profile.table(GPT_LAYER, "none").values
    assert np.all(np.isfinite(layer["fwd_ms"])) and np.all(layer["fwd_ms"] > 0)
    first_bytes = path.read_bytes()

    # second run: read from the cache, nothing profiled (profiling would fail loudly)
    def no_profiling(*args, **kwargs):
        raise AssertionError("profiled although the cache holds the profile")
    monkeypatch.setattr(device_costs, "build_cost_profile", no_profiling)
    said.clear()
    assert device_costs.ensure_cost_profile(cfg, spec, 0, None, said.append) == path
    assert said == [f"[train] cost model: reusing the profile {path} (made "
                    f"{profile.meta['created']} in {profile.meta['seconds']} s)"]
    assert path.read_bytes() == first_bytes
    # the planner reads it: a source built from the flags costs a shape
    from dynapipe_ext.plan.iteration_planner import build_cost_model
    model = build_cost_model(device_costs.cost_model_source(cfg, 1, spec=spec), spec, 1, 1)
    assert model.stage_costs(3, 50, 0, 1) is not None
    assert model.stage_costs(500, 7, 0, 1) is not None          # rows above, length below

    # a corrupt file is reported and profiled again
    monkeypatch.undo()
    path.write_text('{"version": 1, "key": {"model": "gp')
    said.clear()
    with single_process_world(seed=3):
        import torch
        device_costs.ensure_cost_profile(cfg, spec, 0, torch.device("cpu"), said.append)
    assert "cached cost profile unusable" in said[0] and str(path) in said[0]
    assert "profiling GPT" in said[0] and "wrote" in said[-1]
    assert load_profile(path).key == profile.key


def test_cache_that_stops_short_of_the_run_or_is_for_another_key_is_not_used(tmp_path):
    cfg = run_config(tmp_path)
    spec = spec_of(cfg)
    with single_process_world(seed=3):
        import torch
        path = device_costs.ensure_cost_profile(cfg, spec, 0, torch.device("cpu"),
                                                lambda line: None)
    key = device_costs.run_profile_key(cfg, spec)
    longer = run_config(tmp_path, "--max-position-embeddings", "64")
    assert device_costs.profile_cache_path(longer, spec_of(longer)) == path   # same key
    assert cached_profile(tmp_path, key, 64, 0)[1] is not None
    _, profile, why = cached_profile(tmp_path, key, 128, 0)
    assert profile is None and "stops short" in why
    data = json.loads(path.read_text())
    data["key"]["dtype"] = "bfloat16"
    path.write_text(json.dumps(data))
    _, profile, why = cached_profile(tmp_path, key, 64, 0)
    assert profile is None and "dtype: file has 'bfloat16', expected 'float32'" in why


@pytest.mark.slow
def test_t5_profile_has_every_layer_kind(tmp_path):
    cfg = run_config(tmp_path, model="t5")
    spec = spec_of(cfg)
    with single_process_world(seed=3):
        import torch
        path = device_costs.ensure_cost_profile(cfg, spec, 0, torch.device("cpu"),
                                                lambda line: None)
    profile = load_profile(path)
    assert profile_covers(profile, 32, 16) and not profile_covers(profile, 32, 17)
    enc = profile.table(ENC_LAYER, "selective").values["activation_bytes"]
    assert np.all(np.isfinite(enc)) and np.all(np.diff(enc, axis=0) > 0)
    model = ProfiledCostModel(profile, below_grid="bound", rows_above_grid="scale")
    assert model.stage_costs(2, 30, 10, 2, "full") is not None


# ---------------------------------------------------------------------------- several ranks

def _ensure(rank, world_size, cache_dir, tp, pp, bad_dir):
    import torch
    from megatron.base.distributed_setup import setup_model_parallel
    cfg = run_config(cache_dir, "--tensor-model-parallel-size", str(tp),
                     "--pipeline-model-parallel-size", str(pp), "--num-layers", "2")
    spec = spec_of(cfg)
    layout = setup_model_parallel(tp, pp, seed=1, timeout_s=60, total_layers=spec.total_layers,
                                  num_stages=pp, vocab_size=spec.vocab_size,
                                  num_attention_heads=spec.num_attention_heads)
    if bad_dir and rank == 0:     # rank 0 cannot write its cache: every rank must fail alike
        cfg = run_config(bad_dir, "--tensor-model-parallel-size", str(tp),
                         "--pipeline-model-parallel-size", str(pp), "--num-layers", "2")
    said = []
    try:
        path = device_costs.ensure_cost_profile(cfg, spec, rank, layout.device, said.append)
    except device_costs.CostProfileError as err:
        return "error", str(err)
    return str(path), said, torch.distributed.get_world_size()


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", [(1, 2), (2, 1)])
def test_rank_zeros_tp_group_profiles_the_others_wait(tmp_path, tp, pp):
    first = run_in_processes(_ensure, 2, (tmp_path, tp, pp, None), timeout_s=300)
    assert first[0][0] == first[1][0] and os.path.exists(first[0][0])
    assert "profiling GPT" in first[0][1][0] and first[1][1] == []     # rank 0 speaks
    key = load_profile(first[0][0]).key
    assert key["tensor_model_parallel_size"] == tp
    again = run_in_processes(_ensure, 2, (tmp_path, tp, pp, None), timeout_s=300)
    assert again[0][1] == [line for line in again[0][1] if "reusing the profile" in line]


@pytest.mark.slow
def test_a_failed_profile_is_the_same_error_on_every_rank(tmp_path):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("a file where the cache directory should be")
    results = run_in_processes(_ensure, 2, (tmp_path / "ok", 1, 2, blocker), timeout_s=300)
    assert [r[0] for r in results] == ["error", "error"]
    assert results[0][1] == results[1][1] and "rank 0" in results[0][1]


@pytest.mark.slow
def test_pretrain_profiles_on_first_run_and_reuses_on_the_second(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    env.pop("RANK", None)

    def tool(*args):
        subprocess.run([sys.executable, *args], cwd=REPO, env=env, check=True,
                       capture_output=True, text=True, timeout=120)
    tool("tools/make_flan_sample.py", "--output", str(data / "flan.jsonl"), "--num-samples",
         "200", "--seed", "7")
    tool("tools/train_tokenizer.py", "--input", str(data / "flan.jsonl"), "--model-prefix",
         str(data / "sp"), "--vocab-size", "1000")
    tool("tools/preprocess_flan.py", "--input", str(data / "flan.jsonl"), "--output-prefix",
         str(data / "flan"), "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model",
         str(data / "sp.model"), "--no-progress")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "pretrain_gpt.py", "--data-path", str(data / "flan"),
           "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model",
           str(data / "sp.model"), "--num-layers", "2", "--hidden-size", "32",
           "--num-attention-heads", "2", "--seq-length", "64", "--tokens-per-global-batch",
           "512", "--pipeline-model-parallel-size", "2", "--train-iters", "2",
           "--distributed-timeout-minutes", "3", "--cost-model", "profile",
           "--cost-model-cache-dir", str(tmp_path / "cache")]
    outs = []
    for _ in range(2):
        done = subprocess.run(cmd[:7] + ["--master-port", str(free_port())] + cmd[7:],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        outs.append(done)
    assert "[train] cost model: profiling GPT" in outs[0].stdout
    assert "profiling the cost model" in outs[0].stderr           # the progress bar
    assert "[train] cost model: reusing the profile" in outs[1].stdout
    assert "profiling" not in outs[1].stdout + outs[1].stderr
    assert outs[1].stdout.count("iter 2/2") == 1


@pytest.mark.slow
def test_throughput_bench_plans_with_the_profile(tmp_path):
    from dynapipe_ext.report.throughput import report_markdown
    run_tool("tools/make_flan_sample.py", "--output", tmp_path / "flan.jsonl", "--num-samples",
             "200", "--seed", "5")
    run_tool("tools/train_tokenizer.py", "--input", tmp_path / "flan.jsonl", "--model-prefix",
             tmp_path / "sp", "--vocab-size", "600")
    run_tool("tools/preprocess_flan.py", "--input", tmp_path / "flan.jsonl", "--output-prefix",
             tmp_path / "flan", "--tokenizer-type", "SentencePieceTokenizer",
             "--tokenizer-model", tmp_path / "sp.model", "--no-progress")
    out, cache = tmp_path / "bench.json", tmp_path / "cache"
    run_tool("tools/bench_throughput.py",
             "--data-path", tmp_path / "flan", "--tokenizer-model", tmp_path / "sp.model",
             "--models", "t5", "--max-lengths", "128", "--tokens-per-global-batch", "512",
             "--strategies", "dynamic", "--warmup-iters", "1", "--iters", "1", "--num-layers", "2",
             "--hidden-size", "32", "--num-attention-heads", "2", "--nproc", "2", "--pp", "2",
             "--device", "cpu", "--timeout-minutes", "4", "--cost-model", "profile",
             "--cost-model-cache-dir", cache, "--work-dir", tmp_path / "work",
             "--output", out, timeout=600)
    result = json.loads(out.read_text())
    assert "error" not in result["rows"][0] and result["rows"][0]["tokens_per_s"] > 0
    assert result["settings"]["cost_model"] == "profile"
    [profile] = cache.glob("t5-*.json")
    assert load_profile(profile).key["model"] == "t5"
    assert "the run's profile (--cost-model profile)" in report_markdown(result, {})


@pytest.mark.slow
def test_check_tool_compares_both_models_with_measured_times(tmp_path):
    argv = ["t5", "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2",
            "--encoder-seq-length", "64", "--decoder-seq-length", "16",
            "--tokens-per-global-batch", "256", "--vocab-size", "128",
            "--cost-model-cache-dir", str(tmp_path), "--shapes", "1x64x16,4x16x8,2x40x12",
            "--repeats", "1", "--output", str(tmp_path / "check.json")]
    run_tool("tools/check_cost_model.py", *argv, timeout=300)
    result = json.loads((tmp_path / "check.json").read_text())
    assert [(r["rows"], r["seq_len"], r["dec_seq_len"]) for r in result["shapes"]] == [
        (1, 64, 16), (4, 16, 8), (2, 40, 12)]
    for row in result["shapes"]:
        assert row["measured_cpu_ms"] > 0 and row["analytic_ms"] > 0 and row["profile_ms"] > 0
    assert set(result["summary"]) == {"analytic", "profile"}
    assert result["summary"]["profile"]["max_shape_error_pct"] >= \
        result["summary"]["profile"]["median_shape_error_pct"]
    # --measured takes the times from the earlier output instead of timing again
    run_tool("tools/check_cost_model.py", *argv[:-2], "--measured", tmp_path / "check.json",
             "--output", tmp_path / "again.json", timeout=300)
    again = json.loads((tmp_path / "again.json").read_text())
    assert [r["measured_cpu_ms"] for r in again["shapes"]] == \
        [r["measured_cpu_ms"] for r in result["shapes"]]


def test_check_tool_times_packed_streams_priced_by_their_samples(tmp_path):
    """--streams: packed streams of about N tokens of FLAN-like samples (aligned to 8), priced
    as the planners price them (microbatch.packed_cost_shape: rows x seq_len = the slots), and
    timed; --analytic-only makes no profile."""
    argv = ["gpt", "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2",
            "--seq-length", "512", "--max-position-embeddings", "512",
            "--tokens-per-global-batch", "512", "--vocab-size", "128",
            "--cost-model-cache-dir", str(tmp_path / "cache"), "--streams", "64,256",
            "--stream-draws", "2", "--analytic-only", "--repeats", "1",
            "--output", str(tmp_path / "streams.json")]
    run_tool("tools/check_cost_model.py", *argv, timeout=300)
    result = json.loads((tmp_path / "streams.json").read_text())
    assert not (tmp_path / "cache").exists() and set(result["summary"]) == {"analytic"}
    rows = result["shapes"]
    assert [r["stream_tokens"] for r in rows] == [64, 64, 256, 256]
    for r in rows:
        slots = r["rows"] * r["seq_len"]
        assert 8 <= slots <= r["stream_tokens"] + 7 and slots % 8 == 0
        assert r["samples"] >= 1 and r["rows"] >= 1
        assert r["measured_cpu_ms"] > 0 and r["analytic_ms"] > 0
    assert rows[2]["analytic_ms"] > rows[0]["analytic_ms"]
