"""The benchmark script runs end to end (tiny sizes): its figures are what the README records."""

import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_vs_torch.py"


def _run(*options: str, timeout: float) -> subprocess.CompletedProcess:
    """The benchmark in a session of its own, so that a timeout ends its ranks too, not only their parent."""
    process = subprocess.Popen([sys.executable, str(SCRIPT), *options], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = process.communicate(timeout=timeout)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def test_benchmark_runs_and_reports_every_engine_and_the_targets():
    out = _run("--rounds", "2", "--batch", "4", "--microbatches", "2", "--seq-len", "16", "--vocab", "256",
               "--warmup", "0", "--torch-with-our-compute", timeout=300)
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
    out = _run("--batch", "5", "--microbatches", "2", timeout=60)
    assert out.returncode == 2 and "--batch 5 does not split into --microbatches 2" in out.stderr
