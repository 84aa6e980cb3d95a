"""Multi-task multi-modal model description: components (modality encoders, a shared backbone,
task heads) and tasks, each task a sub-graph of components with its own data sizes."""
from __future__ import annotations

from dataclasses import dataclass

ROLES = ("encoder", "backbone", "head")


@dataclass(frozen=True)
class Component:
    """A stack of `num_layers` identical layers of kind `layer_kind` (same kind = same cost per
    token), `params_per_layer` parameters each, emitting activations of width `hidden_size`."""
    name: str
    role: str
    layer_kind: str
    num_layers: int
    params_per_layer: int
    hidden_size: int

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"component {self.name!r}: role must be one of {ROLES}, "
                             f"got {self.role!r}")
        for field in ("num_layers", "params_per_layer", "hidden_size"):
            if getattr(self, field) < 1:
                raise ValueError(f"component {self.name!r}: {field} must be >= 1, "
                                 f"got {getattr(self, field)}")


@dataclass(frozen=True)
class TaskStep:
    """One component used by a task: `seq_len` tokens per sample at that component, fed by the
    outputs of the task's earlier steps named in `inputs` (none: reads the task's data)."""
    component: str
    seq_len: int
    inputs: tuple[str, ...] = ()


@dataclass(frozen=True)
class Task:
    """A task: `batch_size` samples per iteration flowing through its steps (a DAG, listed in
    topological order)."""
    name: str
    batch_size: int
    steps: tuple[TaskStep, ...]


@dataclass(frozen=True)
class MTModel:
    """Components plus tasks; validated so every later pass can trust names and order."""
    components: tuple[Component, ...]
    tasks: tuple[Task, ...]

    def __post_init__(self):
        names = [c.name for c in self.components]
        if len(set(names)) != len(names):
            raise ValueError(f"component names are not unique: {names}")
        if not self.tasks:
            raise ValueError("a model needs at least one task")
        task_names = [t.name for t in self.tasks]
        if len(set(task_names)) != len(task_names):
            raise ValueError(f"task names are not unique: {task_names}")
        for task in self.tasks:
            where = f"task {task.name!r}"
            if task.batch_size < 1:
                raise ValueError(f"{where}: batch_size must be >= 1, got {task.batch_size}")
            if not task.steps:
                raise ValueError(f"{where}: no steps")
            seen: set[str] = set()
            for i, step in enumerate(task.steps):
                if step.component not in names:
                    raise ValueError(f"{where}, step {i}: unknown component {step.component!r}")
                if step.component in seen:
                    raise ValueError(f"{where}, step {i}: component {step.component!r} used twice")
                if step.seq_len < 1:
                    raise ValueError(f"{where}, step {i}: seq_len must be >= 1")
                for src in step.inputs:
                    if src not in seen:
                        raise ValueError(f"{where}, step {i}: input {src!r} is not an earlier "
                                         f"step of the task")
                seen.add(step.component)

    def component(self, name: str) -> Component:
        for c in self.components:
            if c.name == name:
                return c
        raise KeyError(f"no component {name!r}")

    def users(self, component: str) -> tuple[str, ...]:
        """Names of the tasks whose sub-graph uses `component`."""
        return tuple(t.name for t in self.tasks
                     if any(s.component == component for s in t.steps))
