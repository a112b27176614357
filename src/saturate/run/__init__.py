"""The flows that tune and then train, for a preset or a workload described in Python (a user's own script is
`saturate.script`'s):

    flow.run(workload, hardware)   `saturate run`: the cached plan or a tuning that pays for itself (sizing.py),
                                   naive / the guide's plan / the runner-up / tuned side by side in interleaved
                                   rounds (side_by_side.py, each plan kept built between rounds: resident.py),
                                   training with the fastest, the before/after
    grid_sweep.sweep(...)          `saturate sweep`: a grid of workload parameters, each point tuned then trained

They stand on `tune` (the search), `engine` (training) and `stats` (rounds and ratios); nothing below imports them.
"""
