"""Published measurements against pipeplan's predictions: the validation set of issue #12.

`scenarios/validation/published.csv` holds one published figure per row, transcribed from the paper or page
it cites (source, table, case exactly as printed), with the scenario that writes its setting and the
overrides that pick the case (`key=value;key=value`, TOML values, as `--set`). A row is one of:

    memory      peak HBM per GPU (max over ranks) or activation bytes per transformer layer
    time        iteration time, or forward / backward time of one transformer layer
    throughput  in the paper's own unit: samples/s/GPU, tokens/s/GPU, TFLOP/s/GPU by the paper's FLOP
                formula, or MFU/HFU
    ratio       between two other rows of the same source (`ratio_of = "numerator case|denominator case"`),
                e.g. ZB-2p / 1F1B throughput at one model size; predicted as the ratio of their predictions
    oom         whether the setting ran out of memory (published `true` / `false`); predicted by the simulated
                step's peak HBM against the device's capacity less the scenario's memory.hbm_margin_gib

An optional `group` column names rows that compare with each other (one table, one model, one GPU count):
validation_ranking.py ranks each group's time or throughput rows and tabulates the oom rows.

Each setting is simulated once (rows that share a scenario and overrides share the step). A row whose
scenario does not load on this build (a key it does not know yet) is reported with the loader's message
instead of a prediction. Only rows marked `scored = true` enter validation.csv and the error statistics; the
others (figures that repeat a scored one, or settings pipeplan does not model, such as Float8) are kept because
ratios refer to them. Rows marked `scored = calibration` are the anchors of a device's one calibration
(analysis/calibrate.py fits `gemm_efficiency` to them): they are predicted but, being fitted, never scored.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from pipeplan.scenarios import SCENARIO_DIR
from pipeplan.sim.errors import PipeplanError

VALIDATION_DIR = SCENARIO_DIR / "validation"
PUBLISHED_CSV = VALIDATION_DIR / "published.csv"
COLUMNS = ("source", "table", "case", "metric", "quantity", "published", "unit", "scenario", "overrides",
           "ratio_of", "scored", "citation", "notes")
OPTIONAL_COLUMNS = ("group",)  # older sets without it load with every row ungrouped
OUTPUT_COLUMNS = ("source", "table", "case", "metric", "published", "predicted", "rel_error", "group")
METRICS = ("memory", "time", "throughput", "ratio")  # the metrics with a relative error
FIT_METRIC = "oom"  # ran out of memory or not: a confusion table, not an error (validation_ranking.py)

# Issue #12's targets, as (mean |error|, max |error|) per metric; None: no bound on the maximum.
TARGETS: dict[str, tuple[float, float | None]] = {
    "memory": (0.10, 0.20),
    "time": (0.10, 0.20),
    "throughput": (0.10, 0.20),
    "ratio": (0.03, None),
}


@dataclass(frozen=True)
class PublishedFigure:
    """One row of published.csv."""

    source: str
    table: str
    case: str
    metric: str
    quantity: str
    published: float
    unit: str
    scenario: str  # file name, relative to the CSV's folder; empty for ratios
    overrides: dict[str, Any] = field(default_factory=dict)
    ratio_of: tuple[str, str] | None = None
    scored: bool = True
    citation: str = ""
    notes: str = ""
    calibration: bool = False  # an anchor of its device's calibration (scored = calibration): not validation
    group: str = ""  # rows comparable with each other (ranking); empty: in no group

    @property
    def setting(self) -> tuple[str, tuple[tuple[str, str], ...]]:
        """Rows with the same setting share one simulated step."""
        return self.scenario, tuple(sorted((k, repr(v)) for k, v in self.overrides.items()))


@dataclass(frozen=True)
class Prediction:
    figure: PublishedFigure
    predicted: float | None
    reason: str = ""  # why there is no prediction

    @property
    def rel_error(self) -> float | None:
        if self.predicted is None or self.figure.metric == FIT_METRIC:
            return None
        return (self.predicted - self.figure.published) / self.figure.published


class Setting:
    """One scenario with its overrides, resolved lazily: cost table, memory plan, simulated step."""

    def __init__(self, path: Path, overrides: dict[str, Any]):
        from pipeplan.sim.config import load_scenario

        self.scenario = load_scenario(path, overrides)

    @cached_property
    def costs(self) -> Any:
        from pipeplan.sim.costs import build_cost_table

        return build_cost_table(self.scenario)

    @cached_property
    def plan(self) -> Any:
        """The memory plan the step runs under, from the one resolver (memory.plan = true: the MILP's choice)."""
        from pipeplan.sim.step import resolve_schedule
        from pipeplan.solver.step import resolve_memory_plan

        return resolve_memory_plan(self.scenario, self.costs, resolve_schedule(self.scenario)).plan

    @cached_property
    def result(self) -> Any:
        from pipeplan.solver.step import simulate_with_memory_policy

        return simulate_with_memory_policy(self.scenario)[0]

    @property
    def step_time_s(self) -> float:
        """The step's wall time. Issue #12's simulator reports it as `step_time_s` (the pipeline's makespan
        plus the data-parallel reduction and optimizer step); before that model, the makespan is the step."""
        res = self.result
        return float(getattr(res, "step_time_s", res.makespan_s))

    @property
    def fits(self) -> bool:
        """Does the simulated step fit HBM less the scenario's margin (sim.trace.hbm_fit, what `simulate` says)?"""
        from pipeplan.sim.trace import hbm_fit

        return hbm_fit(self.result).fits

    @property
    def gpus(self) -> int:
        par = self.scenario.parallel
        return self.scenario.pipeline.stages * par.tp * par.dp * par.cp

    @property
    def samples_per_step(self) -> int:
        sc = self.scenario
        return sc.pipeline.microbatches * sc.training.micro_batch_size * sc.parallel.dp

    def middle_chunk(self) -> int:
        """A chunk holding transformer layers only (neither the embedding nor the LM head): chunk 1."""
        if self.scenario.num_chunks < 3:
            raise PipeplanError("per-layer figures read a middle chunk: set pipeline.stages so the scenario has "
                                "at least 3 chunks (e.g. override pipeline.stages=4)")
        return 1


# ---- the papers' own FLOP counts, used only to express a predicted time in the paper's unit -----------------

def narayanan_flops(batch: int, s: int, layers: int, h: int, vocab: int) -> float:
    """Narayanan et al. 2021, Eq. 3: FLOPs per iteration with activation recomputation."""
    return 96 * batch * s * layers * h**2 * (1 + s / (6 * h) + vocab / (16 * layers * h))


def korthikanti_model_flops(batch: int, s: int, layers: int, h: int, vocab: int) -> float:
    """Korthikanti et al. 2022, Eq. 7: model FLOPs per iteration."""
    return 72 * batch * layers * s * h**2 * (1 + s / (6 * h) + vocab / (12 * h * layers))


def korthikanti_hardware_flops(batch: int, s: int, layers: int, h: int, vocab: int) -> float:
    """Korthikanti et al. 2022, Eq. 8: hardware FLOPs per iteration under selective recomputation."""
    return 72 * batch * layers * s * h**2 * (1 + s / (3 * h) + vocab / (12 * h * layers))


def _flops_per_gpu_s(flops: Callable[..., float]) -> Callable[[Setting], float]:
    def rate(st: Setting) -> float:
        m = st.scenario.model
        assert m is not None
        total = flops(st.samples_per_step, m.seq_len, m.layers, m.hidden, m.vocab)
        return total / (st.step_time_s * st.gpus)
    return rate


def _utilisation(flops: Callable[..., float]) -> Callable[[Setting], float]:
    rate = _flops_per_gpu_s(flops)
    return lambda st: rate(st) / (st.scenario.device.resolved()["peak_tflops"] * 1e12)


def _layer(st: Setting, part: str) -> float:
    """One transformer layer's forward or backward time (recomputation included) or kept activation bytes,
    per microbatch: a middle chunk's figure over its layer count."""
    k, c = st.middle_chunk(), st.costs
    layers = float(c.detail.layers[k])
    if part == "activation":
        return float(st.plan.kept_bytes[k]) / layers
    forward = float(c.forward_s[k])
    backward = float(c.backward_input_s[k] + c.backward_weight_s[k] + st.plan.recompute_s[k])
    return {"forward": forward, "backward": backward, "combined": forward + backward}[part] / layers


@dataclass(frozen=True)
class Quantity:
    """What a row measures: its metric, how to read it off a setting (in base units), and its units."""

    metric: str
    read: Callable[[Setting], float] | None  # None: a ratio, predicted from the two rows it names
    units: dict[str, float]  # unit name -> size of one unit in base units


_BYTES = {"GiB": 2.0**30, "GB": 1e9, "MiB": 2.0**20}
_SECONDS = {"s": 1.0, "ms": 1e-3}
QUANTITIES: dict[str, Quantity] = {
    "peak_hbm": Quantity("memory", lambda st: float(np.max(st.result.peak_hbm_bytes)), _BYTES),
    "layer_activation": Quantity("memory", lambda st: _layer(st, "activation"), _BYTES),
    "step_time": Quantity("time", lambda st: st.step_time_s, _SECONDS),
    "layer_forward": Quantity("time", lambda st: _layer(st, "forward"), _SECONDS),
    "layer_backward": Quantity("time", lambda st: _layer(st, "backward"), _SECONDS),
    "layer_combined": Quantity("time", lambda st: _layer(st, "combined"), _SECONDS),
    "samples_per_gpu_s": Quantity(
        "throughput", lambda st: st.samples_per_step / (st.step_time_s * st.gpus), {"samples/s/GPU": 1.0}),
    "tokens_per_gpu_s": Quantity(
        "throughput",
        lambda st: st.samples_per_step * st.scenario.model.seq_len / (st.step_time_s * st.gpus),
        {"tokens/s/GPU": 1.0}),
    "tflops_per_gpu": Quantity("throughput", _flops_per_gpu_s(narayanan_flops), {"TFLOP/s/GPU": 1e12}),
    "mfu": Quantity("throughput", _utilisation(korthikanti_model_flops), {"%": 0.01}),
    "hfu": Quantity("throughput", _utilisation(korthikanti_hardware_flops), {"%": 0.01}),
    "ratio": Quantity("ratio", None, {"1": 1.0}),
    "oom": Quantity(FIT_METRIC, lambda st: 0.0 if st.fits else 1.0, {"bool": 1.0}),
}


# ---- reading published.csv ----------------------------------------------------------------------------------

def load_published(path: str | Path | None = None) -> list[PublishedFigure]:
    """Read and check published.csv; a bad file or row raises PipeplanError naming the row and field."""
    from pipeplan.analysis.sweep import parse_scalar

    path = Path(path) if path is not None else PUBLISHED_CSV
    from io import StringIO

    from pipeplan.common.io import InputError, read_input_bytes
    from pipeplan.sim.limits import MAX_SCENARIO_BYTES

    try:  # a fifo is refused before it is opened (it would wait for a writer forever), a huge file before reading
        text = read_input_bytes(path, MAX_SCENARIO_BYTES, "--published").decode()
        reader = csv.DictReader(StringIO(text, newline=""))
        missing = [c for c in COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise PipeplanError(f"{path}: missing columns {', '.join(missing)}; need {', '.join(COLUMNS)}")
        raw = list(reader)
    except InputError as exc:
        raise PipeplanError(str(exc)) from None
    except (UnicodeDecodeError, csv.Error) as exc:
        raise PipeplanError(f"{path}: not a readable CSV ({exc})") from None
    figures: list[PublishedFigure] = []
    for n, r in enumerate(raw, start=2):
        where = f"{path.name} line {n}"
        quantity = QUANTITIES.get(r["quantity"])
        if quantity is None:
            raise PipeplanError(f"{where}: quantity {r['quantity']!r} unknown; allowed: {', '.join(QUANTITIES)}")
        if r["metric"] != quantity.metric:
            raise PipeplanError(f"{where}: metric {r['metric']!r} does not fit quantity {r['quantity']!r}; "
                                f"it is a {quantity.metric} (metrics: {', '.join((*METRICS, FIT_METRIC))})")
        if r["unit"] not in quantity.units:
            raise PipeplanError(f"{where}: unit {r['unit']!r} for {r['quantity']}; allowed: "
                                f"{', '.join(quantity.units)}")
        if r["metric"] == FIT_METRIC:
            if r["published"] not in ("true", "false"):
                raise PipeplanError(f"{where}: published must be true (ran out of memory) or false for metric "
                                    f"{FIT_METRIC}, got {r['published']!r}")
            published = 1.0 if r["published"] == "true" else 0.0
        else:
            try:
                published = float(r["published"])
            except ValueError:
                raise PipeplanError(f"{where}: published {r['published']!r} is not a number") from None
            if not math.isfinite(published) or published <= 0:
                raise PipeplanError(f"{where}: published must be a positive number, got {r['published']}")
        if r["scored"] not in ("true", "false", "calibration"):
            raise PipeplanError(f"{where}: scored must be true, false or calibration, got {r['scored']!r}")
        ratio_of = None
        if r["metric"] == "ratio":
            num, sep, den = r["ratio_of"].partition("|")
            if not sep or not num or not den:
                raise PipeplanError(f"{where}: ratio_of must be 'numerator case|denominator case'")
            ratio_of = (num, den)
        elif not r["scenario"]:
            raise PipeplanError(f"{where}: scenario is empty; name a TOML file next to {path.name}")
        overrides: dict[str, Any] = {}
        for item in filter(None, (s.strip() for s in r["overrides"].split(";"))):
            key, sep, value = item.partition("=")
            if not sep or not key.strip() or not value.strip():
                raise PipeplanError(f"{where}: override {item!r}: expected key=value")
            overrides[key.strip()] = parse_scalar(value.strip())
        figures.append(PublishedFigure(
            source=r["source"], table=r["table"], case=r["case"], metric=r["metric"], quantity=r["quantity"],
            published=published, unit=r["unit"], scenario=r["scenario"], overrides=overrides, ratio_of=ratio_of,
            scored=r["scored"] == "true", citation=r["citation"], notes=r["notes"],
            calibration=r["scored"] == "calibration", group=(r.get("group") or "").strip()))
    _check_references(figures, path)
    return figures


def _check_references(figures: list[PublishedFigure], path: Path) -> None:
    direct: set[tuple[str, str]] = set()
    seen: set[tuple[str, str]] = set()
    for f in figures:
        if (f.source, f.case) in seen:
            raise PipeplanError(f"{path.name}: case {f.case!r} appears twice in source {f.source}")
        seen.add((f.source, f.case))
        if f.ratio_of is None:
            direct.add((f.source, f.case))
    for f in figures:
        for ref in f.ratio_of or ():
            if (f.source, ref) not in direct:
                raise PipeplanError(f"{path.name}: ratio {f.case!r} refers to {ref!r}, not a non-ratio case of "
                                    f"{f.source}")


# ---- predicting ----------------------------------------------------------------------------------------------

def predict_all(
    figures: list[PublishedFigure],
    folder: str | Path | None = None,
    progress: Callable[[int, int, str], None] | None = None,
) -> list[Prediction]:
    """Predict every row; ratios last, from the predictions of the rows they name."""
    folder = Path(folder) if folder is not None else VALIDATION_DIR
    direct = [f for f in figures if f.ratio_of is None]
    settings: dict[Any, Setting | str] = {}
    by_case: dict[tuple[str, str], Prediction] = {}
    for i, f in enumerate(direct):
        if progress is not None:
            progress(i, len(direct), f"{f.source}: {f.case}")
        by_case[(f.source, f.case)] = _predict_direct(f, folder, settings)
    if progress is not None:
        progress(len(direct), len(direct), "ratios")
    out = []
    for f in figures:
        if f.ratio_of is None:
            out.append(by_case[(f.source, f.case)])
            continue
        num, den = (by_case[(f.source, c)] for c in f.ratio_of)
        if num.predicted is None or den.predicted is None:  # the reason of the row it misses
            out.append(Prediction(f, None, (num if num.predicted is None else den).reason))
        else:
            out.append(Prediction(f, num.predicted / den.predicted))
    return out


def _predict_direct(f: PublishedFigure, folder: Path, settings: dict[Any, Setting | str]) -> Prediction:
    if f.setting not in settings:
        try:  # a path relative to the working folder keeps the loader's messages short
            path = folder / f.scenario
            settings[f.setting] = Setting(path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path,
                                          f.overrides)
        except PipeplanError as exc:
            settings[f.setting] = str(exc)
    st = settings[f.setting]
    if isinstance(st, str):
        return Prediction(f, None, st)
    quantity = QUANTITIES[f.quantity]
    assert quantity.read is not None, "ratios are predicted from their rows"
    try:
        value = quantity.read(st)
    except PipeplanError as exc:
        return Prediction(f, None, str(exc))
    return Prediction(f, value / quantity.units[f.unit])


# ---- summarising ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ErrorSummary:
    metric: str
    source: str  # "all" for every source together
    cases: int
    predicted: int
    mean_abs_error: float | None
    max_abs_error: float | None

    @property
    def target(self) -> tuple[float, float | None]:
        return TARGETS[self.metric]

    @property
    def meets_target(self) -> bool | None:
        if self.mean_abs_error is None or self.predicted < self.cases:
            return None
        mean_ok = self.mean_abs_error <= self.target[0]
        bound = self.target[1]
        return mean_ok and (bound is None or (self.max_abs_error or 0.0) <= bound)


def summarize(predictions: Iterable[Prediction]) -> list[ErrorSummary]:
    """Mean and max |relative error| of the scored rows per metric and source, then per metric over all."""
    scored = [p for p in predictions if p.figure.scored]
    out = []
    for metric in METRICS:
        rows = [p for p in scored if p.figure.metric == metric]
        sources = sorted({p.figure.source for p in rows})
        for source in [*sources, "all"] if rows else []:
            group = [p for p in rows if source in ("all", p.figure.source)]
            errors = [abs(p.rel_error) for p in group if p.rel_error is not None]
            out.append(ErrorSummary(metric, source, len(group), len(errors),
                                    float(np.mean(errors)) if errors else None,
                                    float(np.max(errors)) if errors else None))
    return out


def validation_table(predictions: Iterable[Prediction]) -> list[dict[str, Any]]:
    """The rows of validation.csv: the scored figures, with their prediction and relative error."""
    rows = []
    for p in predictions:
        if not p.figure.scored:
            continue
        f = p.figure
        rows.append({"source": f.source, "table": f.table, "case": f.case, "metric": f.metric,
                     "published": f.published, "predicted": p.predicted, "rel_error": p.rel_error,
                     "group": f.group})
    return rows
