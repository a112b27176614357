"""What a run's fingerprint holds, and when two fingerprints say the training changed (data/fingerprint.py)."""

from __future__ import annotations

from dataclasses import dataclass

from saturate.policy.fields import rule


@dataclass(frozen=True)
class SameRules:
    """How much of what a run trains on is fingerprinted, and how far two fingerprints may differ."""

    batches: int = rule(8, "a DataLoader's first batches fingerprinted (their samples, their sampler's indices): more "
                        "than one, so a stream each worker replays shows its batches repeating (each worker yields "
                        "its first batch first)", "docs/scripts.md (Keeping the training the same)")
    rows: int = rule(256, "samples of a batch given a digest each: enough to see a batch repeat or reorder, and a "
                     "few milliseconds of hashing per trial", "data/fingerprint.py")
    elements: int = rule(256, "values of a sample read into its digest, strided over the whole sample: two samples "
                         "alike in these are taken as the same", "data/fingerprint.py")
    repeat_margin: float = rule(0.1, "a run whose first samples repeat by this share more than the run as written's "
                                "trains on some samples more than once (two workers replaying a stream repeat "
                                "half of them)", "docs/scripts.md (Keeping the training the same)")
