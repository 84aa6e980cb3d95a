"""Profiled cost model: interpolation, infeasibility outside the grid, profile files, stage
composition and memory limit, and a tiny real profiling run of megatron-core layers."""
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dynapipe_ext.costs.cost_profile import (FIELDS, PROFILE_VERSION, CostProfile, LayerTable,
                                       ProfiledCostModel, ProfileError, find_profile,
                                       layer_axes, load_profile, profile_file_name,
                                       profile_key, profile_kinds, save_profile)
from dynapipe_ext.costs.cost_model import half_layer_shares
from dynapipe_ext.costs.model_spec import (DEC_LAYER, EMBEDDING, GPT_ATTENTION, GPT_LAYER, GPT_MLP,
                                     HEAD, ModelSpec)

REPO = Path(__file__).resolve().parent.parent.parent
ROWS = np.array([1.0, 2.0, 4.0])
SEQS = np.array([16.0, 64.0, 256.0])
DECS = np.array([8.0, 32.0])


def synthetic_value(name, b, s, d=0.0, scale=1.0):
    """A smooth, increasing cost surface (time ~ tokens + attention work)."""
    base = {"fwd_ms": 1.0, "bwd_ms": 2.0, "activation_bytes": 100.0, "shared_bytes": 10.0,
            "peak_bytes": 50.0}[name]
    return scale * base * (b * s + 0.01 * b * s * s + b * d)


def synthetic_table(axes, scale=1.0):
    pts = {"rows": ROWS, "seq_len": SEQS, "dec_seq_len": DECS}
    points = tuple(pts[a] for a in axes)
    grids = np.meshgrid(*points, indexing="ij")
    q = dict(zip(axes, grids))
    values = {n: synthetic_value(n, q["rows"], q.get("seq_len", q.get("dec_seq_len")),
                                 q.get("dec_seq_len", 0.0) if "seq_len" in q else 0.0, scale)
              for n in FIELDS}
    return LayerTable(tuple(axes), points, values)


def synthetic_profile(spec, modes=("none", "selective", "full")):
    tables = {}
    for kind in profile_kinds(spec):
        axes = layer_axes(kind, spec.model)
        kind_modes = modes if kind in (GPT_LAYER, DEC_LAYER) or "layer" in kind else ("none",)
        tables[kind] = {m: synthetic_table(axes, scale={"none": 1.0, "selective": 0.8,
                                                        "full": 0.3}[m]) for m in kind_modes}
    key = profile_key(spec, 1, "test device", "float32")
    counts = {kind: 1000 * (i + 1) for i, kind in enumerate(profile_kinds(spec))}
    return CostProfile(key, counts, {k: 4 * c for k, c in counts.items()}, tables,
                       {"device_memory_bytes": 2**30})


def test_interpolation_is_exact_at_grid_points():
    table = synthetic_table(("rows", "seq_len"))
    for b in ROWS:
        for s in SEQS:
            vals, ok = table.interpolate({"rows": np.array([b]), "seq_len": np.array([s])})
            assert ok[0]
            for name in FIELDS:
                assert vals[name][0] == pytest.approx(synthetic_value(name, b, s))


def test_interpolation_is_monotone_and_between_neighbours():
    table = synthetic_table(("rows", "seq_len"))
    seqs = np.linspace(16, 256, 97)
    vals, ok = table.interpolate({"rows": np.full(seqs.shape, 3.0), "seq_len": seqs})
    assert ok.all()
    assert np.all(np.diff(vals["fwd_ms"]) >= 0)
    lo, _ = table.interpolate({"rows": np.array([2.0]), "seq_len": np.array([100.0])})
    hi, _ = table.interpolate({"rows": np.array([4.0]), "seq_len": np.array([100.0])})
    mid, _ = table.interpolate({"rows": np.array([3.0]), "seq_len": np.array([100.0])})
    assert lo["bwd_ms"][0] < mid["bwd_ms"][0] < hi["bwd_ms"][0]
    assert mid["bwd_ms"][0] == pytest.approx((lo["bwd_ms"][0] + hi["bwd_ms"][0]) / 2)


def test_outside_the_grid_is_infeasible():
    table = synthetic_table(("rows", "seq_len", "dec_seq_len"))
    query = {"rows": np.array([8.0, 2.0, 2.0, 2.0, 0.5]),
             "seq_len": np.array([64.0, 300.0, 64.0, 8.0, 64.0]),
             "dec_seq_len": np.array([8.0, 8.0, 33.0, 8.0, 8.0])}
    _, ok = table.interpolate(query)
    assert not ok.any()
    _, ok_bound = table.interpolate(query, below_grid="bound")
    assert ok_bound.tolist() == [False, False, False, True, True]


def test_unmeasured_point_makes_only_its_cells_infeasible():
    table = synthetic_table(("rows", "seq_len"))
    table.values["fwd_ms"][2, 2] = np.nan           # rows 4, seq 256 could not be measured
    _, ok = table.interpolate({"rows": np.array([4.0, 3.0, 4.0, 2.0]),
                               "seq_len": np.array([256.0, 200.0, 64.0, 256.0])})
    assert ok.tolist() == [False, False, True, True]


def test_stage_costs_sum_layers_and_none_outside_grid():
    spec = ModelSpec("gpt", 4, 64, 4, 100)
    model = ProfiledCostModel(synthetic_profile(spec))
    costs = model.stage_costs(2, 64, 0, 2, "none")
    one = {n: synthetic_value(n, 2, 64) for n in FIELDS}
    # stage 0 = embedding + 2 layers, stage 1 = 2 layers + head; every synthetic kind is equal
    assert costs[0].fwd_ms == pytest.approx(3 * one["fwd_ms"])
    assert costs[1].bwd_ms == pytest.approx(3 * one["bwd_ms"])
    # kept: each layer's own bytes + shared bytes once per kind on the stage
    assert costs[0].activation_bytes == pytest.approx(
        3 * one["activation_bytes"] + 2 * one["shared_bytes"], abs=1)
    assert costs[0].peak_bytes == pytest.approx(one["peak_bytes"], abs=1)
    assert model.stage_costs(2, 257, 0, 2, "none") is None
    assert model.stage_costs(8, 64, 0, 2, "full") is None
    full = model.stage_costs(2, 64, 0, 2, "full")
    assert full[0].activation_bytes < costs[0].activation_bytes
    arrays = model.stage_cost_arrays(np.array([2, 2, 8]), np.array([64, 100, 64]),
                                     np.array([0, 0, 0]), 2, "none")
    assert arrays.feasible.tolist() == [True, True, False]
    assert arrays.fwd_ms[0, 0] == pytest.approx(costs[0].fwd_ms)


def test_t5_decoder_costs_depend_on_decoder_length():
    spec = ModelSpec("t5", 2, 64, 4, 100, num_decoder_layers=2)
    model = ProfiledCostModel(synthetic_profile(spec))
    short = model.stage_costs(2, 64, 8, 2, "none")
    longer = model.stage_costs(2, 64, 32, 2, "none")
    assert longer[1].fwd_ms > short[1].fwd_ms
    assert model.stage_costs(2, 64, 64, 2, "none") is None


def test_memory_limit_is_device_memory_minus_model_states():
    spec = ModelSpec("gpt", 4, 64, 4, 100)
    profile = synthetic_profile(spec)
    model = ProfiledCostModel(profile, device_memory_bytes=1e9, num_stages=2)
    counts = profile.param_count
    # fp32 Adam: 16 bytes per parameter; stage 1 = 2 layers + head is the heavier one
    stage0 = (counts["embedding"] + 2 * counts["gpt_layer"]) * 16
    stage1 = (2 * counts["gpt_layer"] + counts["head"]) * 16
    assert model.activation_memory_limit() == pytest.approx(1e9 - max(stage0, stage1))
    assert model.activation_memory_limit(stage_to_rank=(0, 0)) == pytest.approx(
        1e9 - stage0 - stage1)
    bf16 = ProfiledCostModel(profile, device_memory_bytes=1e9, bytes_per_param_state=18)
    assert bf16.activation_memory_limit(num_stages=1) == pytest.approx(
        1e9 - 18 * (counts["embedding"] + 4 * counts["gpt_layer"] + counts["head"]))


def test_save_load_round_trip_and_key_checks(tmp_path):
    spec = ModelSpec("t5", 2, 64, 4, 100, num_decoder_layers=2)
    profile = synthetic_profile(spec)
    profile.tables[DEC_LAYER]["none"].values["peak_bytes"][0, 0, 0] = np.nan
    path = save_profile(tmp_path / profile_file_name(profile.key), profile)
    loaded = load_profile(path, expect_key=profile.key)
    assert loaded.key == profile.key and loaded.param_count == profile.param_count
    for kind, modes in profile.tables.items():
        for mode, table in modes.items():
            for name in FIELDS:
                np.testing.assert_array_equal(loaded.tables[kind][mode].values[name],
                                              table.values[name])
    assert find_profile(tmp_path, spec, 1, "test device", "float32").key == profile.key
    other = profile_key(spec, 2, "test device", "float32")
    with pytest.raises(ProfileError, match="tensor_model_parallel_size: file has 1, expected 2"):
        load_profile(path, expect_key=other)
    with pytest.raises(ProfileError, match="no cost profile"):
        find_profile(tmp_path, spec, 1, "test device", "bfloat16")
    data = json.loads(path.read_text())
    data["version"] = PROFILE_VERSION + 1
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match="version"):
        load_profile(path)


def test_file_names_differ_when_keys_differ():
    spec = ModelSpec("gpt", 2, 64, 4, 100)
    names = {profile_file_name(profile_key(spec, tp, dev, dt))
             for tp in (1, 2) for dev in ("cpu x", "NVIDIA H100") for dt in ("float32", "bfloat16")}
    assert len(names) == 8


def run_profiler(tmp_path, *extra):
    out = subprocess.run(
        [sys.executable, str(REPO / "tools/profile_cost_model.py"), "--num-layers", "2",
         "--hidden-size", "64", "--num-attention-heads", "2", "--vocab-size", "128",
         "--max-position-embeddings", "128", "--micro-batch-sizes", "1,2", "--repeats", "1",
         "--threads", "1", "--quiet", "--output", str(tmp_path), *extra],
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    files = list(tmp_path.glob("*.json"))
    assert len(files) == 1
    return load_profile(files[0])


def test_real_gpt_profile_measures_megatron_layers(tmp_path):
    profile = run_profiler(tmp_path, "--model", "gpt", "--seq-lengths", "16,64")
    assert profile.modes() == ("none", "selective", "full")
    layer = {m: profile.table(GPT_LAYER, m).values for m in profile.modes()}
    for mode, values in layer.items():
        assert np.all(values["fwd_ms"] > 0) and np.all(values["bwd_ms"] > 0), mode
        # kept bytes grow with the sequence length (axis 1) and the rows (axis 0)
        assert np.all(values["activation_bytes"][:, 1] > values["activation_bytes"][:, 0])
        assert np.all(values["activation_bytes"][1, :] > values["activation_bytes"][0, :])
    assert np.all(layer["full"]["activation_bytes"] < layer["selective"]["activation_bytes"])
    assert np.all(layer["selective"]["activation_bytes"] < layer["none"]["activation_bytes"])
    # full recompute keeps exactly the layer input: seq x rows x hidden fp32
    np.testing.assert_array_equal(layer["full"]["activation_bytes"],
                                  np.outer([1, 2], [16, 64]) * 64 * 4)
    head = profile.table(HEAD, "none").values
    assert np.all(head["activation_bytes"] > 0)
    # a GPT layer holds 4h^2 + 2h*ffn weights (+ biases and norms)
    assert profile.param_count[GPT_LAYER] >= 12 * 64 * 64
    model = ProfiledCostModel(profile, num_stages=2)
    assert model.stage_costs(2, 40, 0, 2, "none") is not None
    assert model.stage_costs(2, 65, 0, 2, "none") is None
    # a stage cut inside layer 0 costs the same work in all, from the same measurements
    halves = ProfiledCostModel(profile, num_stages=2,
                               spec=dataclasses.replace(profile.spec, pipeline_cut=(1, 3)))
    for mode in profile.modes():
        whole, cut = (m.stage_costs(2, 40, 0, 2, mode) for m in (model, halves))
        assert sum(c.fwd_ms for c in cut) == pytest.approx(sum(c.fwd_ms for c in whole))
        assert cut[0].fwd_ms < whole[0].fwd_ms


def test_real_t5_profile_has_decoder_grid(tmp_path):
    profile = run_profiler(tmp_path, "--model", "t5", "--seq-lengths", "16,32",
                           "--dec-seq-lengths", "8,16", "--recompute-modes", "none,full")
    dec = profile.table(DEC_LAYER, "none")
    assert dec.axes == ("rows", "seq_len", "dec_seq_len")
    kept = dec.values["activation_bytes"]
    assert np.all(kept[:, :, 1] > kept[:, :, 0])
    # the encoder output seen by cross-attention is shared by all decoder layers of a stage
    assert np.all(dec.values["shared_bytes"][:, 1, :] > dec.values["shared_bytes"][:, 0, :])
    assert np.all(profile.table(DEC_LAYER, "full").values["activation_bytes"] < kept)
    model = ProfiledCostModel(profile)
    assert model.stage_costs(1, 20, 10, 2, "full") is not None
    with pytest.raises(ProfileError, match="no 'selective'"):
        model.stage_costs(1, 20, 10, 2, "selective")


def test_times_interpolate_as_power_laws_and_bytes_linearly():
    seqs = np.array([16.0, 64.0, 256.0])
    quadratic = np.array([[s * s for s in seqs]])
    values = {name: quadratic for name in FIELDS}
    values["bwd_ms"] = np.array([[3.0 * s for s in seqs]])
    table = LayerTable(("rows", "seq_len"), (np.array([1.0]), seqs), values)
    vals, ok = table.interpolate({"rows": np.array([1.0, 1.0]), "seq_len": np.array([32.0,
                                                                                     100.0])})
    assert ok.all()
    np.testing.assert_allclose(vals["fwd_ms"], [32.0**2, 100.0**2])      # exact for s^2
    np.testing.assert_allclose(vals["bwd_ms"], [96.0, 300.0])            # and for s
    # bytes stay multi-linear: a third of the way from 16 to 64 -> a third of the way up
    assert vals["activation_bytes"][0] == pytest.approx(256 + (4096 - 256) / 3)
    # a zero corner falls back to linear interpolation instead of failing
    values["fwd_ms"] = np.array([[0.0, 4.0, 8.0]])
    zero = LayerTable(("rows", "seq_len"), (np.array([1.0]), seqs), values)
    vals, ok = zero.interpolate({"rows": np.array([1.0]), "seq_len": np.array([40.0])})
    assert ok[0] and vals["fwd_ms"][0] == pytest.approx(2.0)


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_half_layers_are_shares_of_the_measured_gpt_layer(recompute):
    """Half layers are not profiled: a stage cut inside a layer costs its halves as the
    measured whole layer x their analytic shares, so the stages' total work is unchanged."""
    spec = ModelSpec("gpt", 4, 64, 4, 100)
    profile = synthetic_profile(spec)
    even = ProfiledCostModel(profile, num_stages=2)
    uneven = ProfiledCostModel(profile, num_stages=2,
                               spec=dataclasses.replace(spec, pipeline_cut=(3, 5)))
    assert uneven.spec.stage_layers(2)[0] == (EMBEDDING, GPT_LAYER, GPT_ATTENTION)
    rows, seqs = np.array([1.0, 2.0, 4.0, 3.0, 8.0]), np.array([16.0, 64.0, 256.0, 100.0, 64.0])
    a, c = (m.stage_cost_arrays(rows, seqs, 0 * rows, 2, recompute) for m in (even, uneven))
    assert c.feasible.tolist() == a.feasible.tolist() == [True] * 4 + [False]
    ok = a.feasible
    for name in ("fwd_ms", "bwd_ms"):
        np.testing.assert_allclose(getattr(c, name)[:, ok].sum(axis=0),
                                   getattr(a, name)[:, ok].sum(axis=0), rtol=1e-12)
    query = {"rows": rows[ok], "seq_len": seqs[ok]}
    layer, _ = profile.table(GPT_LAYER, recompute).interpolate(query)
    emb, _ = profile.table(EMBEDDING, recompute).interpolate(query)
    share = half_layer_shares(spec, 1, rows[ok], seqs[ok], recompute)[GPT_ATTENTION]
    # under 'full' each half keeps its own input: the cut layer keeps one more layer input
    extra = layer["activation_bytes"] if recompute == "full" else 0.0
    np.testing.assert_allclose(c.activation_bytes[:, ok].sum(axis=0),
                               a.activation_bytes[:, ok].sum(axis=0) + extra, rtol=1e-12)
    # stage 0: embedding + a layer + the attention half; shared tensors once per stage
    np.testing.assert_allclose(c.fwd_ms[0, ok],
                               emb["fwd_ms"] + layer["fwd_ms"] * (1 + share["fwd_ms"]))
    np.testing.assert_allclose(c.bwd_ms[0, ok],
                               emb["bwd_ms"] + layer["bwd_ms"] * (1 + share["bwd_ms"]))
    np.testing.assert_allclose(
        c.activation_bytes[0, ok],
        emb["activation_bytes"] + emb["shared_bytes"] + layer["shared_bytes"]
        + layer["activation_bytes"] * (1 + share["activation_bytes"]))
    np.testing.assert_allclose(c.peak_bytes[0, ok], np.maximum(emb["peak_bytes"],
                                                               layer["peak_bytes"]))
    assert 0 < share["fwd_ms"].min() and share["fwd_ms"].max() < 1
    assert sum(uneven.model_state_bytes(2)) == pytest.approx(sum(even.model_state_bytes(2)))
    # stage 0 holds layer 1's attention half only: its MLP half's states moved to stage 1
    moved = even.model_state_bytes(2)[0] - uneven.model_state_bytes(2)[0]
    param_share = half_layer_shares(spec)[GPT_MLP]["param_count"]
    assert 0 < param_share < 1
    assert moved == pytest.approx(profile.param_count[GPT_LAYER] * param_share * 16)


def test_a_stage_of_half_layers_alone():
    """A stage of an MLP half and the next attention half: the MLP half shares no tensors,
    its peak is bounded by the whole layer's."""
    spec = ModelSpec("gpt", 4, 64, 4, 100, pipeline_cut=(3, 2, 3))
    profile = synthetic_profile(ModelSpec("gpt", 4, 64, 4, 100))
    model = ProfiledCostModel(profile, spec=spec)
    assert spec.stage_layers(3)[1] == (GPT_MLP, GPT_ATTENTION)
    middle = model.stage_costs(2, 64, 0, 3, "none")[1]
    layer, _ = profile.table(GPT_LAYER, "none").interpolate(
        {"rows": np.array([2.0]), "seq_len": np.array([64.0])})
    shares = half_layer_shares(spec, 1, 2.0, 64.0, "none")
    kept = sum(shares[k]["activation_bytes"] for k in (GPT_MLP, GPT_ATTENTION))
    assert middle.fwd_ms == pytest.approx(layer["fwd_ms"][0])
    assert middle.activation_bytes == pytest.approx(
        layer["activation_bytes"][0] * kept + layer["shared_bytes"][0], abs=1)
    assert middle.peak_bytes == pytest.approx(layer["peak_bytes"][0], abs=1)


def test_the_runs_spec_must_match_the_profile_but_for_tying_and_the_cut(tmp_path):
    from dynapipe_ext.plan.iteration_planner import CostModelSource, build_cost_model
    spec = ModelSpec("gpt", 4, 64, 4, 100)
    profile = synthetic_profile(spec)
    run = dataclasses.replace(spec, pipeline_cut=(5, 3), tied_embeddings=True)
    assert ProfiledCostModel(profile, spec=run).spec == run
    with pytest.raises(ValueError, match="cost profile is for .* this run trains"):
        ProfiledCostModel(profile, spec=dataclasses.replace(spec, hidden_size=128))
    path = save_profile(tmp_path / profile_file_name(profile.key), profile)
    model = build_cost_model(CostModelSource.profile(str(path)), run, 1, 2)
    assert model.spec.stage_layers(2)[1][0] == GPT_MLP
    with pytest.raises(ValueError, match=f"{path.name}: cost profile is for"):
        build_cost_model(CostModelSource.profile(str(path)),
                         dataclasses.replace(run, num_layers=8, pipeline_cut=()), 1, 2)
