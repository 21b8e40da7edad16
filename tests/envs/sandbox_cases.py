"""What the sandbox tests run: tight limits that still let an honest program finish on a loaded
machine, and the honest program with the test cases it passes."""

from __future__ import annotations

from shoal.envs.sandbox import Limits, TestCase

LIMITS = Limits(
    cpu_s=1, memory_mb=256, file_size_mb=1, disk_mb=4, open_files=16, processes=8, timeout_s=4.0
)
SQUARE = [TestCase("f(2)", 4), TestCase("f(3)", 9)]
GOOD = "def f(x):\n    return x * x\n"
