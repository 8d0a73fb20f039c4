"""The machine line of the benchmarks' output: which processor a table was measured on."""

from __future__ import annotations

import platform


def cpu_name() -> str:
    """The processor's model name (``/proc/cpuinfo`` on Linux), else what ``platform`` knows
    (often only ``x86_64``)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
