"""Host CPU use is read only over an interval the CPU time counters resolve."""

from __future__ import annotations

import time

from saturate.hardware import host_sensors


def test_a_cpu_reading_too_soon_after_the_last_is_unmeasured_not_zero():
    host_sensors.read_host(prime_cpu=True)
    soon = host_sensors.read_host()
    assert soon.cpu_pct is None and "under the 100 ms" in soon.missing["cpu_pct"]
    time.sleep(host_sensors.MIN_CPU_INTERVAL_S + 0.05)
    later = host_sensors.read_host()
    assert later.cpu_pct is not None and "cpu_pct" not in later.missing
