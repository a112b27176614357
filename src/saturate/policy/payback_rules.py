"""When tuning pays for itself: the shares of a job a search, a side-by-side or a compilation may spend."""

from __future__ import annotations

from dataclasses import dataclass

from saturate.policy.fields import rule


@dataclass(frozen=True)
class PaybackRules:
    """What share of a job's predicted training the tuning, the side-by-side and a compilation may cost."""

    # --- the tuning budget (run/sizing.py tuning_budget), from the untuned training predicted for the job --------
    saving_share: float = rule(0.5, "the share of a found saving the search may spend on finding more; the rest is "
                               "the user's (the side-by-side spends no more than the search left of it)",
                               "tune/state.py SearchState.earn; run/sizing.py least_allowance")
    tuning_share: float = rule(0.10, "the first tuning budget, what a search that finds nothing costs: 17 s of a 20 % "
                               "budget for nothing made a 150-step job 1.12x its untuned wall time",
                               "AVX2 CPU without native bf16, 2026-11-23 (docs/benchmarks.md, fifth session)")
    grown_share: float = rule(0.20, "the budget grows by saving_share of what the search found up to this share: on "
                              "the main job on an AVX-512 CPU, bf16 at 1.4-1.9x buys the rest of the search",
                              "docs/benchmarks.md, 2026-11-23 (fifth session); docs/architecture.md")
    long_base_s: float = rule(60.0, "...and up to this base plus long_share of the training: a search's stages are "
                              "a fixed number of trials, so a longer job needs longer windows, not more trials",
                              "run/sizing.py tuning_budget; tests/run/test_side_by_side.py")
    long_share: float = rule(0.05, "...the share beyond long_base_s: a half-hour job tunes for at most 150 s (8 %), "
                             "not 360 s", "run/sizing.py tuning_budget; tests/run/test_side_by_side.py")
    budget_floor_s: float = rule(10.0, "a job whose first budget is under this is not tuned (the default plan "
                                 "trains): below it the search holds about two trials", "run/sizing.py tuning_budget")
    budget_ceiling_s: float = rule(600.0, "the most a tuning budget is or grows to (the budget when nothing predicts "
                                   "the training)", "run/sizing.py tuning_budget; run/flow.py")
    informed_share: float = rule(0.05, "the first budget's share from the informed plan: the search starts where "
                                 "earlier ones ended up; the 300-step peers' job searched 20-27 s and kept the "
                                 "default plan's settings in 3 runs of 3 while its peers ended 21-33 s sooner",
                                 "bench/peers.py, 2-core Zen 4, 2026-11-27, sessions 10-12 (docs/benchmarks.md)")
    informed_floor_s: float = rule(15.0, "the floor from the informed plan: 15 s holds the starting plan and two "
                                   "alternatives", "bench/peers.py, 2026-11-27, sessions 10-12 (docs/benchmarks.md)")
    naive_warmup: int = rule(3, "warm-up steps before naive's one measurement that sizes the budget: a process's "
                             "first steps are cold (after one warm-up step gpt-tiny naive read 0.97 s/step where the "
                             "same plan trained at 0.86: 13 % on the budget)", "run/flow.py (measuring naive once)")
    untuned_apart: float = rule(0.1, "two predictions of the untuned training this far apart (a share of the "
                                "side-by-side's) are both printed: naive's one measurement before tuning is cold and "
                                "under the load of its moment (2372 s and 1047 s in one busy run)",
                                "run/costs.py untuned_line")
    # --- the side-by-side (run/sizing.py size) ----------------------------------------------------------------
    compare_share: float = rule(0.05, "the side-by-side's whole wall time (builds, warm-ups, every row and round) may "
                                "cost this share of the predicted training", "run/sizing.py; docs/tuning.md "
                                "(saturate run: tune, compare, train)")
    least_share: float = rule(0.15, "the least side-by-side (naive and the tuned plan in least_rounds rounds) may "
                              "cost up to this share, and no more than the plan is predicted to save: without it the "
                              "before/after used naive's one measurement, which read 0.65 and 1.21 of a side-by-side",
                              "bench/trust.py, 2026-11-23 (docs/benchmarks.md)")
    least_rounds: int = rule(2, "rounds are dropped down to this and no further: a ratio with a range",
                             "run/sizing.py size")
    full_measure_s: float = rule(3.0, "timed seconds per side-by-side measurement when the job can afford it; a "
                                 "shorter one is said to be too short to resolve a small gain", "run/sizing.py size; "
                                 "run/flow.py _choose")
    min_measure_s: float = rule(0.5, "the shortest a side-by-side measurement is sized to (it still times at least "
                                "two steps)", "run/sizing.py size")
    held_share: float = rule(0.5, "the plans the side-by-side keeps built together may use this share of the "
                             "memory capacity (the loader and the run after need the rest)", "run/resident.py")
    # --- a compilation, a short script ------------------------------------------------------------------------
    compile_stake: float = rule(0.05, "the compile trial's budget grows by what a compilation lacks, up to this share "
                                "of the predicted training: it is paid before its steps show a gain (a cold compile "
                                "of the peers' GPT-2 took 24-35 s for trials 7-16 % faster; the 2000-step job's "
                                "budget had 9.7 s left for it)", "2-core AMX Xeon, 2026-11-29 (tune/stake.py)")
    compile_least_s: float = rule(5.0, "the least a compilation of a script's model costs: a loop whose planned "
                                  "training at its best speed so far is shorter has no compile trial (a 3-layer MLP's "
                                  "first compiled step took 11.7 s cold and 6.2 s from inductor's cache)",
                                  "2-vCPU AMD EPYC (AVX2), 2026-12-02 (script/compile_stage.py)")
    least_growth_s: float = rule(0.5, "a budget grown (a stake, a saving earned) by less than this is left as it "
                                 "was: the budget is said in whole seconds, and under half a second reads as no "
                                 "change", "tune/stake.py staked; tune/state.py SearchState.earn")
    short_factor: float = rule(2.0, "a script job shorter than this many times its tuning could not pay the tuning "
                               "back even at 2x faster: run -- CMD trains it untuned", "script/short_job.py")
    trials_plain: int = rule(4, "about how many trial-lengths a plain loop's tuning takes, its side-by-side "
                             "included (short_factor's tuning)", "script/short_job.py")
    trials_framework: int = rule(8, "...and a framework Trainer's (more stages)", "script/short_job.py")
