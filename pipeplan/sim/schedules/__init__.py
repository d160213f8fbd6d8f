"""Schedule generators, looked up by name. Adding a schedule is one module and one `@register` line.

Each generator takes (ranks p, microbatches m, virtual_stages v) and returns a validated `Schedule` whose
stages are the p*v model chunks. Loop placement (gpipe, 1f1b, interleaved-1f1b, zb-h1) puts stage s on rank
s % p; V placement (zbv and the other V-shaped schedules) puts stage s on rank s for s < p and 2p-1-s after.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from pipeplan.sim.errors import ScheduleError
from pipeplan.sim.ir import Schedule

if TYPE_CHECKING:
    from pipeplan.sim.schedules.v_shape import ActionTimes

ScheduleBuilder = Callable[[int, int, int], Schedule]  # (p, m, v) -> the order
SizeCheck = Callable[[int, int, int], str | None]  # returns why (p, m, v) is not allowed, or None


class CappedScheduleBuilder(Protocol):
    """A builder that also takes an admission cap, a stash limit and a list clock (pipeline.*); called with
    (p, m, v) alone it builds its default order, so it is a ScheduleBuilder too."""

    def __call__(self, p: int, m: int, v: int, admission_cap: int | None = None, stash_limit: int | None = None,
                 times: ActionTimes | None = None, /) -> Schedule: ...


@dataclass(frozen=True)
class ScheduleSpec:
    name: str
    build: ScheduleBuilder
    check: SizeCheck
    summary: str
    virtual_stages: int = 1  # the v it is usually run with (sweeps, tests)
    sweep: bool = False  # one of the schedules `pipeplan plan --sweep-cap` compares
    build_capped: CappedScheduleBuilder | None = None  # `build` again, for schedules registered with register_capped

    @property
    def takes_cap(self) -> bool:
        """Its builder takes an admission cap, a stash limit and a list clock (pipeline.*)."""
        return self.build_capped is not None


SCHEDULES: dict[str, ScheduleSpec] = {}


def _add(spec: ScheduleSpec) -> None:
    """Put `spec` in the registry; a name already taken is refused (two modules would shadow each other)."""
    if spec.name in SCHEDULES:
        raise ValueError(f"schedule {spec.name!r} is registered twice ({SCHEDULES[spec.name].build.__module__} "
                         f"and {spec.build.__module__})")
    SCHEDULES[spec.name] = spec


def register(
    name: str, check: SizeCheck, summary: str, *, virtual_stages: int = 1, sweep: bool = False,
) -> Callable[[ScheduleBuilder], ScheduleBuilder]:
    """Register a (p, m, v) generator under `name`."""

    def deco(fn: ScheduleBuilder) -> ScheduleBuilder:
        _add(ScheduleSpec(name, fn, check, summary, virtual_stages, sweep))
        return fn

    return deco


def register_capped(
    name: str, check: SizeCheck, summary: str, *, virtual_stages: int = 1, sweep: bool = False,
) -> Callable[[CappedScheduleBuilder], CappedScheduleBuilder]:
    """Register under `name` a generator that also takes pipeline.admission_cap, stash_limit and order_timing."""

    def deco(fn: CappedScheduleBuilder) -> CappedScheduleBuilder:
        _add(ScheduleSpec(name, fn, check, summary, virtual_stages, sweep, build_capped=fn))
        return fn

    return deco


def loop_placement(p: int, v: int) -> tuple[int, ...]:
    return tuple(s % p for s in range(p * v))


def v_placement(p: int) -> tuple[int, ...]:
    return tuple(s if s < p else 2 * p - 1 - s for s in range(2 * p))


def exact_virtual_stages(v: int, want: int) -> str | None:
    """The usual `check` for schedules that take exactly `want` model chunks per rank."""
    return None if v == want else f"needs pipeline.virtual_stages = {want} (got {v})"


def build_schedule(name: str, ranks: int, microbatches: int, virtual_stages: int = 1,
                   admission_cap: int | None = None, stash_limit: int | None = None,
                   times: ActionTimes | None = None) -> Schedule:
    """Generate schedule `name`; sizes it cannot take are a ScheduleError naming the field and the rule.
    `admission_cap`, `stash_limit` and `times` go to schedules registered with takes_cap (their activation cap
    and when a pending W runs first, in chunk-activations, and the clock their list scheduler runs on)."""
    _import_builtin()
    if name not in SCHEDULES:
        raise ScheduleError(f"pipeline.schedule: unknown schedule {name!r}; allowed: {', '.join(SCHEDULES)}")
    spec = SCHEDULES[name]
    if ranks < 1 or microbatches < 1 or virtual_stages < 1:
        raise ScheduleError("pipeline: stages, microbatches and virtual_stages must all be >= 1")
    why = spec.check(ranks, microbatches, virtual_stages)
    if why:
        raise ScheduleError(f"pipeline: schedule {name!r} {why}")
    if admission_cap is None and stash_limit is None and times is None:
        return spec.build(ranks, microbatches, virtual_stages).validate()
    if spec.build_capped is None:
        key, what = next((k, w) for k, w, given in (
            ("admission_cap", "activation cap", admission_cap), ("stash_limit", "W stash limit", stash_limit),
            ("order_timing", "cost-timed order (its order is fixed)", times)) if given is not None)
        takers = [n for n, sp in SCHEDULES.items() if sp.takes_cap]
        leave = 'set it to "unit"' if key == "order_timing" else "leave it out"
        raise ScheduleError(f"pipeline.{key}: schedule {name!r} has no {what} ({leave}); "
                            f"schedules that take one: {', '.join(takers)}")
    return spec.build_capped(ranks, microbatches, virtual_stages, admission_cap, stash_limit, times).validate()


def default_virtual_stages(name: str) -> int:
    """Chunks per rank a scenario gets when it names `name` without pipeline.virtual_stages (1 if unknown:
    the unknown name is reported by whoever validates it)."""
    _import_builtin()
    spec = SCHEDULES.get(name)
    return spec.virtual_stages if spec is not None else 1


def virtual_stages_for(name: str, ranks: int, microbatches: int, current: int | None) -> int:
    """`current` if schedule `name` takes it at this size, else the schedule's default: switching a scenario
    to zbv with --schedule alone must not require also knowing that zbv wants 2 chunks per rank."""
    _import_builtin()
    spec = SCHEDULES.get(name)
    if current is not None and (spec is None or spec.check(ranks, microbatches, current) is None):
        return current
    return default_virtual_stages(name)


def size_problem(name: str, ranks: int, microbatches: int, virtual_stages: int) -> str | None:
    """Why schedule `name` cannot take (ranks, microbatches, virtual_stages), or None when it can."""
    _import_builtin()
    return SCHEDULES[name].check(ranks, microbatches, virtual_stages)


def schedule_names() -> list[str]:
    _import_builtin()
    return list(SCHEDULES)


def sweep_schedules() -> dict[str, int]:
    """Name -> virtual stages of the schedules a cap sweep compares (registered with sweep=True), one chunk per
    rank first, then in registration order."""
    _import_builtin()
    specs = sorted((s for s in SCHEDULES.values() if s.sweep), key=lambda s: s.virtual_stages)
    return {s.name: s.virtual_stages for s in specs}


def _import_builtin() -> None:
    # Importing the modules runs their @register lines.
    from pipeplan.sim.schedules import builtin  # noqa: F401
