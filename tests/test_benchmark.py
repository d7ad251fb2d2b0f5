"""The benchmark script runs end to end (tiny sizes): its figures are what the README records."""

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_vs_torch.py"


def test_benchmark_runs_and_reports_every_engine_and_the_targets():
    out = subprocess.run([sys.executable, str(SCRIPT), "--rounds", "2", "--batch", "4", "--microbatches", "2",
                          "--seq-len", "16", "--vocab", "256", "--warmup", "0", "--torch-with-our-compute"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    number = r"\d+\.\d{3}"
    for engine in ("ours gpipe", "ours 1f1b", "torch gpipe", "torch 1f1b", "torch gpipe \\+our compute",
                   "torch 1f1b \\+our compute"):
        assert re.search(rf"^{engine} +\d+\.\d +{number} \[{number}, {number}\]", out.stdout, re.M), out.stdout
    for schedule in ("gpipe", "1f1b"):
        assert re.search(rf"^floor of our {schedule} +: +\d+\.\d ms/step.*\n  compute per microbatch by rank: "
                         rf"\[\d+\.\d, \d+\.\d\] ms \(the largest {number}x their mean; all ranks' compute "
                         rf"{number}x T_single\)$", out.stdout, re.M), out.stdout
        assert re.search(rf"^target ours {schedule}: {number} of torch \((met|missed): at most 0\.95\), {number} of the "
                         rf"ideal \((met|missed): within 10%\)$", out.stdout, re.M), out.stdout


def test_benchmark_refuses_bad_options_in_one_line():
    out = subprocess.run([sys.executable, str(SCRIPT), "--batch", "5", "--microbatches", "2"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--batch 5 does not split into --microbatches 2" in out.stderr
