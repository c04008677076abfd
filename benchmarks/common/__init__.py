"""What the benchmarks share: process control (:mod:`common.procs`), statistics
(:mod:`common.stats`) and report writing (:mod:`common.report`).

The benchmarks run as scripts (``python benchmarks/x.py``), so ``benchmarks/`` is
``sys.path[0]`` and this package imports as ``common``. Only the standard library
is imported at module level: a missing benchmark requirement (psutil, matplotlib)
must still reach the script's ``require(...)`` check (benchmarks/_deps.py) first.
"""
