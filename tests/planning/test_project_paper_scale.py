"""Paper-scale projection: the cost-law fit and the fitted-law projection path."""
import numpy as np
import pytest

from dynapipe_ext.costs.cost_profile import (FIELDS, CostProfile, LayerTable, layer_axes,
                                       profile_key, profile_kinds)
from dynapipe_ext.costs.model_spec import GPT_LAYER, HEAD, ModelSpec
from dynapipe_ext.costs.fitted_cost_model import (FittedLawCostModel, fit_cost_laws,
                                                  fit_nonnegative, law_features)
from dynapipe_ext.plan.paper_projection import project

GRID = {"rows": [1.0, 2.0, 4.0], "seq_len": [32.0, 128.0, 512.0], "dec_seq_len": [16.0, 64.0]}


def true_coef(kind: str, field: str, names) -> dict:
    """Known positive coefficients, distinct per term and field."""
    base = {"fwd_ms": 1e-6, "bwd_ms": 2e-6, "activation_bytes": 4.0, "shared_bytes": 1.0,
            "peak_bytes": 8.0}[field]
    return {n: base * (i + 1) * (1e-3 if "flops" in n else 1.0) for i, n in enumerate(names)}


def synthetic_profile(spec: ModelSpec) -> tuple[CostProfile, dict]:
    """A profile whose every table is exactly a known law of law_features."""
    tables, truth = {}, {}
    for kind in profile_kinds(spec):
        axes = layer_axes(kind, spec.model)
        points = tuple(np.asarray(GRID[a]) for a in axes)
        mesh = dict(zip(axes, np.meshgrid(*points, indexing="ij")))
        b, s, d = (mesh.get(a, np.ones_like(mesh["rows"])) for a in
                   ("rows", "seq_len", "dec_seq_len"))
        time, size = law_features(kind, spec, b, s, d)
        values, truth[kind] = {}, {}
        for field in FIELDS:
            named = time if field.endswith("_ms") else size
            coef = true_coef(kind, field, named)
            truth[kind][field] = coef
            values[field] = sum(c * named[n] for n, c in coef.items())
        tables[kind] = {"none": LayerTable(axes, points, values)}
    key = profile_key(spec, 1, "cpu", "float32")
    return CostProfile(key, {k: 1 for k in tables}, {k: 4 for k in tables}, tables), truth


def small_spec(model: str, hidden: int, heads: int) -> ModelSpec:
    return ModelSpec(model, num_layers=4, hidden_size=hidden, num_attention_heads=heads,
                     vocab_size=512, num_decoder_layers=4 if model == "t5" else 0,
                     max_position_embeddings=2048)


def test_nonnegative_fit_recovers_coefficients():
    rng = np.random.default_rng(0)
    x = {"a": rng.uniform(1, 100, 40), "b": rng.uniform(1e3, 1e5, 40), "c": np.ones(40)}
    y = 0.5 * x["a"] + 2e-3 * x["b"] + 7.0
    coef, fitted = fit_nonnegative(x, y)
    assert coef == pytest.approx({"a": 0.5, "b": 2e-3, "c": 7.0}, rel=1e-6)
    np.testing.assert_allclose(fitted, y, rtol=1e-6)


@pytest.mark.parametrize("model", ["gpt", "t5"])
def test_fit_cost_laws_recovers_known_laws_from_two_hidden_sizes(model):
    profiles, truths = zip(*(synthetic_profile(small_spec(model, h, a))
                             for h, a in ((64, 2), (128, 4))))
    laws = fit_cost_laws(list(profiles))
    for kind, by_field in truths[0].items():
        for field, coef in by_field.items():
            fit = laws[kind]["none"][field]
            assert fit["coef"] == pytest.approx(coef, rel=1e-4), (kind, field)
            assert fit["max_rel_err"] < 1e-6


def test_fitted_cost_model_scales_to_a_larger_model_and_projection_runs():
    profiles = [synthetic_profile(small_spec("gpt", h, a))[0] for h, a in ((64, 2), (128, 4))]
    laws = fit_cost_laws(profiles)
    big = small_spec("gpt", 256, 4)
    cost = FittedLawCostModel(big, laws, tp=2, max_seq_len=1024, num_stages=2)
    arr = cost.stage_cost_arrays(np.array([1, 1, 2]), np.array([128, 512, 512]),
                                 np.zeros(3), 2)
    total = arr.fwd_ms.sum(axis=0)
    assert total[1] > total[0] and total[2] > total[1]      # grows with length and rows
    # the fitted law evaluated at the larger hidden equals the law itself (it is exact here)
    time, _ = law_features(GPT_LAYER, big, 1, 512, 0, tp=2)
    expect = sum(c * time[n] for n, c in laws[GPT_LAYER]["none"]["fwd_ms"]["coef"].items())
    layers = sum(k == GPT_LAYER for k in big.stage_layers(2)[0])
    head = sum(k == HEAD for k in big.stage_layers(2)[0])
    assert head == 0 and arr.fwd_ms[0, 1] == pytest.approx(
        layers * expect + sum(c * law_features("embedding", big, 1, 512, 0)[0][n] for n, c in
                              laws["embedding"]["none"]["fwd_ms"]["coef"].items()))
    assert not cost.stage_cost_arrays(np.array([1]), np.array([2048]), np.zeros(1),
                                      2).feasible[0]
    rows = project("gpt", 512, 1, 3, laws, spec=small_spec("gpt", 128, 4), tokens=4096)
    by = {r["strategy"]: r for r in rows}
    assert set(by) == {"packing", "dynamic"}
    assert by["packing"]["speedup_vs_packing"] == pytest.approx(1.0)
    assert all(r["tokens_per_s"] > 0 and r["predicted_iteration_ms"] > 0 for r in rows)
    assert by["dynamic"]["tokens_per_s"] / by["packing"]["tokens_per_s"] == pytest.approx(
        by["dynamic"]["speedup_vs_packing"])


def test_fitted_projection_from_profile_files_renders_its_labelled_table(tmp_path):
    from dynapipe_ext.costs.cost_profile import save_profile
    from dynapipe_ext.plan.paper_projection import project_fitted
    from dynapipe_ext.report.throughput import cpu_fit_section
    paths = []
    for h, a in ((64, 2), (128, 4)):
        profile, _ = synthetic_profile(small_spec("t5", h, a))
        paths.append(save_profile(tmp_path / f"t5_{h}.json", profile))
    fit = project_fitted({"t5": paths}, max_lengths=(512,), batches=1)
    assert {(r["model"], r["max_len"], r["strategy"]) for r in fit["rows"]} == {
        ("t5", 512, "packing"), ("t5", 512, "dynamic")}
    assert [p["hidden_size"] for p in fit["profiles"]["t5"]] == [64, 128]
    assert fit["fits"]["t5"]["summary"]["fwd_ms"]["max_rel_err_worst"] < 1e-6
    text = "\n".join(cpu_fit_section(fit))
    assert "SIMULATION" in text and "fitted to a profile of this CPU" in text
    dyn = next(r for r in fit["rows"] if r["strategy"] == "dynamic")
    assert "| t5 | 512 |" in text and f"{dyn['speedup_vs_packing']:.2f}x" in text
