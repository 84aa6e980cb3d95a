"""plan_iteration: a global batch becomes every rank's checked, serialised execution plan,
byte-identical however (and wherever) it is computed."""
import pickle

import numpy as np
import pytest

from dynapipe_ext.costs.cost_model import CostModel, StageCostArrays
from dynapipe_ext.plan.iteration_planner import (CostModelSource, IterationPlannerConfig,
                                            build_cost_model, choose_auto_layout, iteration_plan_fn,
                                            pipeline_layout, plan_iteration,
                                            schedule_candidates, split_that_runs)
from dynapipe_ext.costs.model_spec import ModelSpec
from dynapipe_ext.runtime.plan_ahead import PlanAhead, PlanningFailed
from dynapipe_ext.plan.plan_checker import check_plans
from dynapipe_ext.batching.planners import PlannerConfig, plan_micro_batches
from dynapipe_ext.schedule.schedule_ir import interleaved_layout, linear_layout, wave_layout
from dynapipe_ext.schedule.schedules import MemoryLimitError
from dynapipe_ext.plan.serialization import plan_from_bytes

GPT = ModelSpec("gpt", num_layers=4, hidden_size=128, num_attention_heads=4, vocab_size=512)
T5 = ModelSpec("t5", num_layers=2, hidden_size=128, num_attention_heads=4, vocab_size=512,
               num_decoder_layers=2)


def gpt_config(schedule="auto", pp=2, dp=2, **kw) -> IterationPlannerConfig:
    planner = PlannerConfig(model="gpt", max_seq_len=256, pipeline_stages=pp, data_parallel=dp)
    return IterationPlannerConfig(GPT, planner, kw.pop("micro_batching", "dynamic"), schedule,
                                  pp=pp, dp=dp, check_plans=True,
                                  cost_model=CostModelSource.analytic(max_seq_len=256), **kw)


def t5_config(schedule="auto", pp=2, dp=1) -> IterationPlannerConfig:
    planner = PlannerConfig(model="t5", max_seq_len=256, max_dec_seq_len=64,
                            pipeline_stages=pp, data_parallel=dp)
    return IterationPlannerConfig(T5, planner, "dynamic", schedule, pp=pp, dp=dp,
                                  check_plans=True, cost_model=CostModelSource.analytic(
                                      max_seq_len=256, max_dec_seq_len=64))


def gpt_lengths(iteration: int) -> np.ndarray:
    return np.random.default_rng(iteration).integers(8, 256, size=96)


def t5_lengths(iteration: int) -> np.ndarray:
    rng = np.random.default_rng(50 + iteration)
    return np.stack([rng.integers(8, 256, size=80), rng.integers(2, 64, size=80)], axis=1)


def decoded(plan, dp_rank, pp):
    return [plan_from_bytes(plan.plan_bytes[(dp_rank, p)]) for p in range(pp)]


@pytest.mark.parametrize("schedule", ["auto", "1f1b", "adaptive", "interleaved", "wave"])
@pytest.mark.parametrize("model", ["gpt", "t5"])
def test_plans_pass_the_checker_and_cover_the_batch_once(model, schedule):
    config = gpt_config(schedule) if model == "gpt" else t5_config(schedule)
    lengths = gpt_lengths(3) if model == "gpt" else t5_lengths(3)
    plan = plan_iteration(3, lengths, config)
    assert set(plan.plan_bytes) == {(d, p) for d in range(config.dp) for p in range(config.pp)}
    seen = []
    for d in range(config.dp):
        rank_plans = decoded(plan, d, config.pp)
        check_plans(rank_plans, config.spec)
        for p, rank_plan in enumerate(rank_plans):
            assert (rank_plan.iteration, rank_plan.dp_rank, rank_plan.pp_rank) == (3, d, p)
            assert rank_plan.stage_to_rank == pipeline_layout(config)
            assert rank_plan.micro_batches == plan.batch_plan.replicas[d]
        seen += [s for mb in rank_plans[0].micro_batches for s in mb.sample_ids]
    assert sorted(seen) == list(range(len(lengths)))
    assert len(plan.schedules) == config.dp
    assert all(ms > 0 for ms in plan.predicted_ms)
    assert plan.timings_ms["total"] >= plan.timings_ms["split"] > 0


@pytest.mark.parametrize("model", ["gpt", "t5"])
def test_same_inputs_give_byte_identical_plans(model):
    config = gpt_config() if model == "gpt" else t5_config()
    lengths = gpt_lengths(5) if model == "gpt" else t5_lengths(5)
    first = plan_iteration(5, lengths, config)
    again = plan_iteration(5, lengths.copy(), pickle.loads(pickle.dumps(config)))
    assert first.plan_bytes == again.plan_bytes
    other = plan_iteration(6, lengths, config)
    assert other.plan_bytes != first.plan_bytes  # the iteration number is in the plan


def test_every_declared_schedule_runs_by_name_and_among_autos_candidates():
    """A schedule declared in the registry is a --pipeline-schedule value that plans on its own
    layout, and `auto` tries it on every layout it is declared for (built and simulated)."""
    from dynapipe_ext.plan.iteration_planner import PIPELINE_SCHEDULES
    from dynapipe_ext.schedule.registry import SCHEDULES, layout_of, layout_stages
    from dynapipe_ext.schedule.schedule_search import evaluate_candidates, micro_batch_costs
    lengths = gpt_lengths(3)
    for decl in SCHEDULES.values():
        assert decl.name in PIPELINE_SCHEDULES
        config = gpt_config(decl.name)
        assert pipeline_layout(config) == layout_stages(decl.home_layout, 2)
        plan = plan_iteration(3, lengths, config)
        assert all(s.startswith(decl.name) for s in plan.schedules), plan.schedules
        for layout in decl.layouts if decl.in_auto else ():
            auto = gpt_config("auto", auto_layout=layout)
            assert decl.name in schedule_candidates(auto)
            micro_batches = plan_iteration(3, lengths, auto).batch_plan.replicas[0]
            cost_model = build_cost_model(auto.cost_model, GPT, 1, 2)
            found = evaluate_candidates(
                micro_batch_costs(micro_batches, cost_model, GPT), float("inf"), 2,
                schedule_candidates(auto), adaptive_layout=pipeline_layout(auto))
            built = [c for c in found if c.name.startswith(decl.name)]
            assert built and all(c.result is not None for c in built), [c.reason for c in found]
    with pytest.raises(ValueError, match=r"unknown pipeline schedule\(s\) \['zigzag'\]"):
        evaluate_candidates(lambda n: None, 1.0, 2, ("zigzag",))
    with pytest.raises(ValueError, match="unknown pipeline schedule 'zigzag'; choose from"):
        layout_of("zigzag")
    with pytest.raises(ValueError, match="pipeline_schedule must be one of"):
        gpt_config("zigzag")


def test_layout_is_fixed_per_schedule_choice():
    assert pipeline_layout(gpt_config("auto")) == linear_layout(2)
    assert pipeline_layout(gpt_config("adaptive")) == linear_layout(2)
    assert pipeline_layout(gpt_config("wave")) == wave_layout(2, 1)
    assert schedule_candidates(gpt_config("auto")) == ("1f1b", "adaptive")
    assert schedule_candidates(gpt_config("wave")) == ("wave",)
    with pytest.raises(ValueError, match="'wave': 4 transformer layers do not split evenly "
                                         "over 8 pipeline stages"):
        gpt_config("wave", waves=2)
    assert pipeline_layout(gpt_config("interleaved")) == interleaved_layout(2, 2)
    assert pipeline_layout(gpt_config("interleaved", pp=4, virtual_stages=1)) == \
        interleaved_layout(4, 1)
    assert schedule_candidates(gpt_config("auto", auto_layout="wave")) == ("wave", "adaptive")
    assert pipeline_layout(gpt_config("auto", auto_layout="interleaved")) == \
        interleaved_layout(2, 2)
    plan = plan_iteration(0, gpt_lengths(0), gpt_config("wave"))
    assert all(name.startswith("wave") for name in plan.schedules)
    assert plan_from_bytes(plan.plan_bytes[(0, 0)]).stage_to_rank == (0, 1, 1, 0)


def test_inconsistent_config_is_rejected_with_the_field_names():
    planner = PlannerConfig(model="gpt", max_seq_len=256, pipeline_stages=2, data_parallel=1)
    with pytest.raises(ValueError, match=r"planner.pipeline_stages 2 must equal pp 4"):
        IterationPlannerConfig(GPT, planner, pp=4, dp=1)
    with pytest.raises(ValueError, match=r"pipeline_schedule must be one of"):
        IterationPlannerConfig(GPT, planner, pipeline_schedule="gpipe", pp=2, dp=1)
    with pytest.raises(ValueError, match=r"'wave'.*do not split evenly over 12"):
        IterationPlannerConfig(GPT, planner, pipeline_schedule="wave", pp=2, dp=1, waves=3)


def test_cost_model_source_is_a_hashable_picklable_value():
    a = CostModelSource.analytic(max_seq_len=256, device_flops=2e12)
    b = CostModelSource.analytic(device_flops=2e12, max_seq_len=256)
    assert a == b and hash(a) == hash(b)
    assert pickle.loads(pickle.dumps(a)) == a
    with pytest.raises(ValueError, match="needs the profile file's path"):
        CostModelSource("profile")


def test_missing_profile_file_is_a_clear_planning_error(tmp_path):
    missing = tmp_path / "gpt.json"
    planner = PlannerConfig(model="gpt", max_seq_len=256, pipeline_stages=2, data_parallel=1)
    config = IterationPlannerConfig(GPT, planner, pp=2, dp=1,
                                    cost_model=CostModelSource.profile(str(missing)))
    with PlanAhead(iteration_plan_fn(config), gpt_lengths, num_workers=0).start(0) as planner_:
        with pytest.raises(PlanningFailed, match=r"gpt.json: cannot read cost profile"):
            planner_.get(0)


def _plans_from(num_workers: int, first: int, count: int, config) -> list[dict]:
    with PlanAhead(iteration_plan_fn(config), gpt_lengths, num_workers=num_workers,
                   prefetch=2).start(first) as planner:
        return [planner.get(i).value.plan_bytes for i in range(first, first + count)]


def test_background_workers_and_resume_give_the_inline_plans():
    config = gpt_config("auto")
    inline = _plans_from(0, 0, 5, config)
    assert _plans_from(1, 0, 5, config) == inline
    assert _plans_from(2, 0, 5, config) == inline
    assert _plans_from(2, 3, 2, config) == inline[3:]


class MixCostModel(CostModel):
    """Samples up to 64 tokens keep 2.5 bytes per row with no transient; longer ones keep
    nothing but peak at 5 per row: each micro-batch fits a limit of 10 alone (2 rows) while
    a long micro-batch after a short one under 1F1B peaks at 15. Time is mostly a fixed
    overhead, so the split prefers few, full micro-batches."""

    def stage_cost_arrays(self, rows, seq_len, dec_seq_len, num_stages, recompute="none"):
        rows = np.asarray(rows, dtype=float)
        long = np.asarray(seq_len) > 64
        per_stage = lambda v: np.broadcast_to(v, (num_stages,) + rows.shape).copy()  # noqa
        time = per_stage(10.0 + 1e-3 * rows * np.asarray(seq_len))
        return StageCostArrays(time, 2 * time, per_stage(np.where(long, 0.0, 2.5 * rows)),
                               per_stage(np.where(long, 5.0 * rows, 0.0)),
                               np.ones(rows.shape, dtype=bool))

    def activation_memory_limit(self, num_stages=None, stage_to_rank=None):
        return 10.0


def mix_config(schedule: str) -> IterationPlannerConfig:
    planner = PlannerConfig(model="gpt", max_seq_len=256, pipeline_stages=2, data_parallel=1,
                            recompute_modes=("none",), dynamic_layout="padded")
    return IterationPlannerConfig(GPT, planner, "dynamic", schedule, pp=2, dp=1)


def test_a_split_no_schedule_can_run_is_made_again_under_a_lower_limit():
    lengths = np.array([32, 32, 32, 32, 200, 200])
    config = mix_config("1f1b")
    first = plan_micro_batches(lengths, config.planner, MixCostModel(), "dynamic")
    assert [mb.num_rows for mb in first.micro_batches] == [2, 2, 2]   # each needs 10 of 10
    batch, picked = split_that_runs(lengths, config, MixCostModel(), 10.0)
    assert batch.info["memory_retries"] == [5.0]          # lowered by the 1F1B overshoot of 5
    assert picked[0].result.max_peak_memory_bytes <= 10.0
    assert picked[0].schedule.name == "1f1b"
    assert sorted(s for mb in batch.micro_batches for s in mb.sample_ids) == list(range(6))


def test_no_returned_split_exceeds_the_limit_under_its_schedule():
    lengths = np.array([32, 32, 32, 32, 200, 200])
    for schedule in ("auto", "1f1b", "adaptive"):
        _, picked = split_that_runs(lengths, mix_config(schedule), MixCostModel(), 10.0)
        assert all(p.result.max_peak_memory_bytes <= 10.0 for p in picked)
    with pytest.raises(MemoryLimitError, match="no candidate schedule fit the split"):
        split_that_runs(np.array([32, 32, 200]), mix_config("1f1b"), MixCostModel(), 6.0)


@pytest.mark.parametrize("model", ["gpt", "t5"])
def test_auto_runs_on_the_layout_predicted_fastest(model):
    """choose_auto_layout keeps the layout whose plan is predicted fastest; on this batch
    (analytic CPU model, free links) the wave's smaller bubble wins over linear and
    interleaved, and the adaptive search on the wave layout stays a candidate."""
    config = gpt_config("auto", dp=1) if model == "gpt" else t5_config("auto")
    lengths = gpt_lengths(0) if model == "gpt" else t5_lengths(0)
    predicted = {family: max(plan_iteration(0, lengths,
                                            IterationPlannerConfig(**{**config.__dict__,
                                                                      "auto_layout": family})
                                            ).predicted_ms)
                 for family in ("linear", "interleaved", "wave")}
    chosen = choose_auto_layout(config, lengths)
    assert predicted[chosen.auto_layout] == min(predicted.values())
    assert chosen.auto_layout == "wave"
    assert predicted["wave"] < predicted["linear"]
    plan = plan_iteration(1, lengths, chosen)
    assert plan_from_bytes(plan.plan_bytes[(0, 0)]).stage_to_rank == wave_layout(2, 1)
    # a fixed schedule or one pipeline rank keeps its config
    assert choose_auto_layout(gpt_config("1f1b"), gpt_lengths(0)).auto_layout == "linear"


def test_auto_skips_layouts_the_model_does_not_split_into():
    two_layers = ModelSpec("gpt", num_layers=2, hidden_size=128, num_attention_heads=4,
                           vocab_size=512)
    config = IterationPlannerConfig(**{**gpt_config("auto", dp=1).__dict__, "spec": two_layers})
    assert choose_auto_layout(config, gpt_lengths(0)).auto_layout == "linear"


@pytest.mark.parametrize("schedule, chunks", [("1f1b", 1), ("interleaved", 2), ("wave", 2)])
def test_the_split_is_made_for_the_layouts_chunks_per_rank(schedule, chunks):
    """The micro-batch split minimises sum t + (P - 1) / chunks * max t per replica, chunks
    being the stages a rank holds (1 linear, v interleaved, 2W wave)."""
    plan = plan_iteration(0, gpt_lengths(0), gpt_config(schedule, dp=1))
    times = [mb.time_ms for mb in plan.batch_plan.micro_batches]
    assert len(pipeline_layout(gpt_config(schedule, dp=1))) == 2 * chunks
    assert plan.batch_plan.info["objective_ms"] == pytest.approx(
        sum(times) + 1 / chunks * max(times))


@pytest.mark.parametrize("schedule,cut", [("wave", (3, 1, 1, 3)), ("interleaved", (1, 3, 3, 1))])
def test_a_cut_of_every_stage_plans_on_layouts_of_more_stages_than_ranks(schedule, cut):
    """A pipeline cut of all 2*W*P (wave) or v*P (interleaved) stages, in half layers
    (--pipeline-split balanced or units): the split prices each rank's stages together
    (RankCostModel) and the plans pass the checker; it failed with a cut of 4 stages priced
    as 2 before."""
    import dataclasses
    config = gpt_config(schedule, dp=1)
    config = dataclasses.replace(config, spec=dataclasses.replace(GPT, pipeline_cut=cut))
    plan = plan_iteration(2, gpt_lengths(2), config)
    rank_plans = decoded(plan, 0, config.pp)
    check_plans(rank_plans, config.spec)
    assert rank_plans[0].stage_to_rank == pipeline_layout(config)
    assert sorted(s for mb in rank_plans[0].micro_batches for s in mb.sample_ids) == \
        list(range(len(gpt_lengths(2))))
