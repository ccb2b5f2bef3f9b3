"""bench/frameworks_report.py: the slowest rank per step after the warm-up,
from the per-rank logs bench/frameworks.sh leaves."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_report_takes_the_slowest_rank_of_each_step_after_the_warm_up(tmp_path):
    # Two ranks, 4 steps; steps 1-2 are the warm-up (left out). Step 3's
    # slowest rank is rank 1 (900 ms), step 4's rank 0 (700 ms): median 800.
    logs = {
        "vgg16-plain-plain-first": {0: [5000, 5000, 600, 700], 1: [5000, 5000, 900, 650]},
        "vgg16-hook-plain-first": {0: [5000, 5000, 100, 300], 1: [5000, 5000, 200, 100]},
    }
    for name, ranks in logs.items():
        for rank, times in ranks.items():
            # bench/cluster.sh: rank 0's standard output in NAME.out, the others' in NAME.out.r<rank>.log
            lines = [f"rank {rank} step {s + 1} loss {2.0 - s / 10:.4f} {ms} ms" for s, ms in enumerate(times)]
            (tmp_path / (f"{name}.out" if rank == 0 else f"{name}.out.r{rank}.log")).write_text("noise\n" + "\n".join(lines) + "\n")
        (tmp_path / f"{name}.out.r0.log").write_text("rank 0's standard error\n")
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "frameworks_report.py"), str(tmp_path)],
                         capture_output=True, text=True, check=True).stdout
    rows = {line.split("|")[3].strip(): [c.strip() for c in line.split("|")] for line in out.splitlines() if line.startswith("| vgg16")}
    assert rows["plain"][4] == "800 (700–900)", out
    assert rows["plain"][5] == "650 775", out  # each rank's median over steps 3-4
    assert rows["hook"][4] == "250 (200–300)", out
    assert rows["hook"][6] == "3.20", out  # 800 / 250
    assert rows["plain"][7] == "1.7000", out  # rank 0's loss at step 4
    assert (tmp_path / "frameworks.csv").read_text().count("\n") == 3
