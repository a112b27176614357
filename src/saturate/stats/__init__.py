"""The statistics tune/, doctor/ and script/ stand on: how long a figure is timed and how well it is known
(noise.py), two figures compared beyond their noise (comparison.py), two competitors timed in alternating
windows (pairs.py) or interleaved rounds (rounds.py). Decisions are returned as data (`Verdict`, a field),
never recovered from the text that explains them. The bottom floor: nothing of saturate is imported here
but `saturate.errors`."""
