"""One line per doctor run: verdict, first fix, busy cores, the fixed share on the run's threads and on one.

    python probe_shares.py 'bench/results/cpu-2026-11-29/doc*'
"""

import glob
import json
import os
import sys


def share(p: dict, b: int) -> float:
    (b1, b2), (t1, t2) = p["micro_batches"], p["seconds"]
    per = (t2 - t1) / (b2 - b1)
    fixed = max(0.0, t1 - per * b1)
    return fixed / (fixed + per * b)


for d in sorted(glob.glob(sys.argv[1])):
    for f in sorted(glob.glob(d + "/*-doctor.stdout")):
        name = os.path.basename(f).split("-doctor")[0]
        try:
            with open(f) as fh:
                j = json.load(fh)
        except ValueError:
            print(os.path.basename(d), name, "no json")
            continue
        m = j["measurements"]
        s, s1, b = m.get("scaling"), m.get("scaling_one_thread"), m.get("micro_batch")
        busy = (m.get("contention") or {}).get("other_cores")
        fix = j["fixes"][0]["title"][:40] if j["fixes"] else "-"
        own = f"{share(s, b):.2f}" if s else "none"
        one = f"{share(s1, b):.2f} r{min(s1['ratios']):.2f}-{max(s1['ratios']):.2f}" if s1 else "-"
        threads = m.get("threads_ratios") or []
        tr = f" threads x{sorted(threads)[len(threads) // 2]:.1f}" if threads else ""
        print(f"{os.path.basename(d):16} {name:14} {j['verdict']:15} {fix:42} "
              f"busy={busy if busy is None else round(busy, 2)} share={own} one={one}{tr}")
