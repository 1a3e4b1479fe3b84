"""The sixteenth session's rank-64 probe, kept as the command its calls.sh names: the script itself is
reports/h200/seventeenth/r64_probe.py, whose variant sets PROBE=1-11 and ncu mode are this session's
unchanged (the seventeenth added 12 on). Run as before, from the repository root on the H200:
    PROBE=10 PYTHONPATH=/tmp/colora-shim python3 reports/h200/sixteenth/r64_probe.py [--quick]
(without PROBE: 10, this file's default then).
"""
import os
import runpy

os.environ.setdefault("PROBE", "10")
runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "seventeenth", "r64_probe.py"),
               run_name="__main__")
