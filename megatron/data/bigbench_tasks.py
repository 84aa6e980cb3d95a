"""Real multi-task data from BIG-bench JSON tasks (`task.json` files of the bigbench sdist),
rendered as FLAN-style zero-shot and few-shot samples."""
from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

# Defaults of BIG-bench's JSON task format where a task.json leaves them out.
DEFAULT_INPUT_PREFIX = "\nQ: "
DEFAULT_OUTPUT_PREFIX = "\nA: "
DEFAULT_CHOICE_PREFIX = "\n  choice: "
DEFAULT_SHOT_SEPARATOR = "\n"
SOURCE_NAME = "BIG-bench"


class BigBenchError(ValueError):
    """A task.json that cannot be read, naming the file."""


@dataclass(frozen=True)
class BigBenchExample:
    input: str
    target: str
    choices: tuple[str, ...]   # answer options (from target_scores), empty for free-form


@dataclass(frozen=True)
class BigBenchTask:
    name: str
    path: str
    task_prefix: str
    input_prefix: str
    output_prefix: str
    choice_prefix: str
    append_choices: bool
    shot_separator: str
    examples: tuple[BigBenchExample, ...]


def find_task_files(root: str) -> list[tuple[str, str]]:
    """(task name, path) of every task.json under root; subtask names join folders with ':'."""
    if not os.path.isdir(root):
        raise BigBenchError(f"BIG-bench task folder not found: {root}")
    found = []
    for folder, dirs, files in os.walk(root):
        dirs.sort()
        if "task.json" in files:
            rel = os.path.relpath(folder, root)
            top = os.path.basename(os.path.abspath(root))
            name = top if rel == "." else rel.replace(os.sep, ":")
            found.append((name, os.path.join(folder, "task.json")))
    return found


def parse_example(raw: dict, path: str, index: int) -> Optional[BigBenchExample]:
    """One example; None when it has no usable target (e.g. an empty target list). An empty
    input is kept: with a target it is a valid zero-shot sample."""
    if not isinstance(raw, dict) or not isinstance(raw.get("input"), str):
        raise BigBenchError(f"{path}: example {index} has no string 'input'")
    scores = raw.get("target_scores")
    choices: tuple[str, ...] = ()
    target = raw.get("target")
    if isinstance(scores, dict) and scores:
        choices = tuple(str(c) for c in scores)
        if target is None:
            target = max(scores, key=lambda c: scores[c])
    if isinstance(target, list):
        target = next((t for t in target if isinstance(t, str) and t.strip()), None)
    if not isinstance(target, str) or not target.strip():
        return None
    return BigBenchExample(raw["input"], target, choices)


def load_task(name: str, path: str) -> BigBenchTask:
    """Read one task.json (JSON tasks only; programmatic tasks have none)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BigBenchError(f"{path}: cannot read task: {exc}") from exc
    if not isinstance(data, dict) or not isinstance(data.get("examples", []), list):
        raise BigBenchError(f"{path}: 'examples' is not a list")
    # a task split into subtasks has a task.json without examples; its subtasks have them
    examples = [parse_example(raw, path, i) for i, raw in enumerate(data.get("examples", []))]
    return BigBenchTask(
        name=name, path=path, task_prefix=str(data.get("task_prefix", "")),
        input_prefix=str(data.get("example_input_prefix", DEFAULT_INPUT_PREFIX)),
        output_prefix=str(data.get("example_output_prefix", DEFAULT_OUTPUT_PREFIX)),
        choice_prefix=str(data.get("choice_prefix", DEFAULT_CHOICE_PREFIX)),
        append_choices=bool(data.get("append_choices_to_input", True)),
        shot_separator=str(data.get("few_shot_example_separator", DEFAULT_SHOT_SEPARATOR)),
        examples=tuple(e for e in examples if e is not None))


def render_example(task: BigBenchTask, ex: BigBenchExample, with_options: bool) -> str:
    """The prompt of one example: input prefix, input, choices, output prefix."""
    text = task.input_prefix + ex.input
    if with_options and ex.choices:
        text += "".join(task.choice_prefix + c for c in ex.choices)
    return text + task.output_prefix.rstrip(" ")


def render_sample(task: BigBenchTask, ex: BigBenchExample, shots: Sequence[BigBenchExample]
                  ) -> dict:
    """A FLAN-style sample: zero-shot when `shots` is empty, else few-shot."""
    with_options = task.append_choices and bool(ex.choices)
    parts = [render_example(task, s, with_options) + " " + s.target for s in shots]
    parts.append(render_example(task, ex, with_options))
    inputs = (task.task_prefix + task.shot_separator.join(parts)).strip()
    kind = ("fs" if shots else "zs") + ("_opt" if with_options else "_noopt")
    return {"inputs": inputs, "targets": ex.target, "task": task.name, "source": SOURCE_NAME,
            "template_type": kind}


def _other_indices(rng: random.Random, n: int, exclude: int, k: int) -> list[int]:
    """Up to k distinct indices in range(n), none equal to `exclude`."""
    picked = rng.sample(range(n - 1), min(k, n - 1))
    return [j + 1 if j >= exclude else j for j in picked]


def bigbench_samples(root: str, seed: int = 1234, few_shot: int = 3,
                     max_examples_per_task: Optional[int] = None,
                     shot_modes: Sequence[str] = ("zs", "fs")) -> Iterator[dict]:
    """Every JSON task under root: each (sampled) example once per shot mode, few-shot ones
    with `few_shot` other examples of the same task as exemplars. Deterministic by seed."""
    rng = random.Random(seed)
    tasks = [load_task(name, path) for name, path in find_task_files(root)]
    if not tasks:
        raise BigBenchError(f"no task.json files under {root} (point --bigbench-dir at "
                            "bigbench/benchmark_tasks of the unpacked bigbench sdist)")
    for task in tasks:
        indices = list(range(len(task.examples)))
        rng.shuffle(indices)
        if max_examples_per_task is not None:
            indices = indices[:max_examples_per_task]
        for i in indices:
            for mode in shot_modes:
                shots = [task.examples[j] for j in _other_indices(rng, len(task.examples), i,
                                                                  few_shot)] if mode == "fs" else []
                if mode == "fs" and not shots:
                    continue  # a one-example task has nothing to show
                yield render_sample(task, task.examples[i], shots)
