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
        interval = rf"interval \[{number}, {number}\] (wholly within|wholly beyond|across) it"
        assert re.search(rf"^target ours {schedule}: {number} of torch, (met|missed) \(at most 0\.95; {interval}\); "
                         rf"{number} of the ideal, (met|missed) \(within 10%; {interval}\); {number} of the ideal from "
                         rf"our engine's T_single$", out.stdout, re.M), out.stdout
    # Every engine computes what the single-process run does, checked before it is timed.
    differences = re.search(r"^gradients against the single-process run's \(largest difference over the largest "
                            r"value\): (.*)$", out.stdout, re.M)
    assert differences, out.stdout
    found = dict(re.findall(r"(ours \w+|torch \w+(?: \+our compute)?) (\d\.\de-\d\d)", differences[1]))
    assert len(found) == 6 and all(float(d) < 1e-4 for d in found.values()), differences[1]
    assert re.search(rf"^single process, 1 thread, our engine \(one stage, one microbatch\): \d+\.\d ms/step "
                     rf"\(x{number} of the plain step", out.stdout, re.M), out.stdout


def test_the_benchmark_interval_of_a_median_covers_it_at_least_as_often_as_it_says():
    """Order statistics x(k), x(n + 1 - k): at 64 rounds x(24) and x(41), which cover the median 96.7% of the time
    (the percentile bootstrap it replaced took x(25) and x(40): 94.0%, not the 95% it printed)."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from bench_vs_torch import median_interval
    finally:
        sys.path.remove(str(SCRIPT.parent))
    for n, (low, high) in ((64, (24, 41)), (16, (4, 13)), (3, (1, 3))):
        assert median_interval([float(i) for i in range(n, 0, -1)]) == (low, high)
    import math
    assert 1 - 2 * sum(math.comb(64, i) for i in range(24)) / 2**64 >= 0.95 > \
        1 - 2 * sum(math.comb(64, i) for i in range(25)) / 2**64


def test_benchmark_refuses_bad_options_in_one_line():
    out = _run("--batch", "5", "--microbatches", "2", timeout=60)
    assert out.returncode == 2 and "--batch 5 does not split into --microbatches 2" in out.stderr
