"""The published runs predicted after a refit on their own engine's other models: the loop
`dsforge plan --search --measure` runs on a user's machine (predict, measure, refit, predict
again), here with the published measurements as the measured runs.

The default profiles describe dsforge's own engine; the published runs ran others (Composer,
FSDP2 with torch.compile, Megatron-LM with Transformer Engine and overlapped communication),
each on its own GPUs. So the runs are grouped by engine (source) and GPU type, and each run
is predicted by `dsforge.cost.fit.fit` refitted on its group's runs of *other* models
(leave one model out: the runs of one model at other sequence lengths or GPU counts are
near-copies of it, so leaving out one run would let its twins in). That is the question a
user's calibration answers: having measured some models on this stack, how well does the
model predict a new one?

The starting profile is the GPU's default (without dsforge's host floors, as
published_runs.engine_profile) with the attention given a rate of its own (the GEMMs'), so the
refit can tell the attention's share from the GEMMs' where the runs span sequence lengths.
The optimizer step keeps the profile's coefficient (KEEP): the published runs have no step
breakdown to time it, and at 0.1-2% of their steps a fit of a few runs cannot tell its
coefficient from their noise (Megatron-LM's, free, held it at 0 and drew the others with it).
A group with runs of fewer than MIN_MODELS models is not refitted: its runs keep the default
profile's prediction and say so.

    python tools/published_compare.py --out benchmarks/search/published.md
    # section "after", "Refitted on each engine's other models"
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from published_runs import Scored, engine_profile  # beside this file

from dsforge.cost.fit import Point, apply, fit
from dsforge.cost.profile import ClusterProfile
from dsforge.cost.step_time import step_time

KEEP = ("optimizer",)  # terms not fitted (above)
MIN_MODELS = 3  # models a group needs: the refit of two models tells little about a third


@dataclass(frozen=True)
class Refitted:
    """A scored run predicted by a profile refitted on its group's other models."""

    scored: Scored  # as the default profile scored it; `predicted` is replaced by the refit's
    refitted: bool  # False: its group has too few models, the default's prediction stands
    coefficients: dict[str, float] | None = None


def group_key(s: Scored) -> tuple[str, str]:
    return s.row.source, s.row.gpu


def start_profile(s: Scored) -> ClusterProfile:
    """The profile a group's refit starts from: its GPU's default without dsforge's host
    floors, the attention at the GEMMs' efficiency as a rate of its own."""
    profile = engine_profile(s.row)
    return dataclasses.replace(profile, attention_efficiency=profile.compute_efficiency)


def point(s: Scored) -> Point:
    """The run as a measured point: its step time from the published tokens/s."""
    r = s.row
    return Point(label=r.label, resolved=s.resolved,
                 measured_s=r.global_batch * r.seq_len / r.tokens_per_s)


def groups_of(scored: list[Scored]) -> dict[tuple[str, str], list[Scored]]:
    """The scored runs by (source, GPU type), in the order of `scored`."""
    groups: dict[tuple[str, str], list[Scored]] = {}
    for s in scored:
        if s.predicted is not None:
            groups.setdefault(group_key(s), []).append(s)
    return groups


@dataclass(frozen=True)
class GroupFit:
    """A group's refit on all its runs: what the engine on that GPU looks like to dsforge."""

    source: str
    gpu: str
    models: int
    runs: int
    before: ClusterProfile
    after: ClusterProfile
    coefficients: dict[str, float]


def group_fits(scored: list[Scored]) -> list[GroupFit]:
    """Each group with MIN_MODELS models or more, refitted on all of its runs."""
    fits = []
    for (source, gpu), runs in groups_of(scored).items():
        models = len({s.row.model.name for s in runs})
        if models >= MIN_MODELS:
            profile = start_profile(runs[0])
            coefficients = fit([point(s) for s in runs], profile, keep=KEEP)
            fits.append(GroupFit(source, gpu, models, len(runs), profile,
                                 apply(profile, coefficients), coefficients))
    return fits


def refit_all(scored: list[Scored]) -> list[Refitted]:
    """Every scored run, predicted after a leave-one-model-out refit in its group (order kept)."""
    out: dict[int, Refitted] = {}
    for runs in groups_of(scored).values():
        models = {s.row.model.name for s in runs}
        if len(models) < MIN_MODELS:
            continue
        profile = start_profile(runs[0])
        for model in models:
            others = [point(s) for s in runs if s.row.model.name != model]
            coefficients = fit(others, profile, keep=KEEP)
            after = apply(profile, coefficients)
            for s in runs:
                if s.row.model.name == model:
                    predicted_s = step_time(s.resolved, after).total
                    mfu = s.measured * point(s).measured_s / predicted_s
                    out[id(s)] = Refitted(dataclasses.replace(s, predicted=mfu), True, coefficients)
    return [out.get(id(s), Refitted(s, refitted=False)) for s in scored]
