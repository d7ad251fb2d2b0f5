"""Step time of our GPipe and 1F1B against torch.distributed.pipelining on the same stages and data.

    python benchmarks/bench_vs_torch.py [--ranks 2] [--microbatches 8] [--rounds 16] [--schedules gpipe,1f1b]

CPU, gloo, one thread per rank. Every rank builds the same Llama (8 layers, hidden 256) and
keeps the same stage for both engines (our cost-balanced split); a single-process run with one
thread gives T_single (and our engine on one process, one microbatch, a stricter one). Before
timing, each engine's gradients are checked against the single-process run's. The engines take
turns over several rounds, in an order shuffled each round, each running a short block of
consecutive steps; ratios are taken within a round and their median over the rounds is reported
with a 95% confidence interval (order statistics, free of assumptions about the distribution),
so the drift of a busy machine cancels out and one can tell a difference from noise. Besides the
ratio to torch and to the bubble-bound ideal T_single / p * (m + p - 1) / m, each of our schedules is compared with the
same ideal from a T_single taken while every rank runs one (a CPU's cores share caches, memory
bandwidth and clock, which no schedule can help), and with its floor: the step time the
schedule allows with the compute times measured in our run, under which each rank's compute
per microbatch says how even the stages are and what they cost beyond T_single. It also prints
each engine's minor page faults per step on each rank: memory the allocator returned to the
system and takes again is faulted in page by page, a CPU cost that depends on what ran before in
the process.
"""

from __future__ import annotations

import argparse
import collections
import copy
import ctypes
import inspect
import math
import os
import queue
import random
import resource
import signal
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

import pipeline_parallel as pp
from pipeline_parallel.loss import HeadLoss
from pipeline_parallel.models import LlamaConfig, LlamaForCausalLM
from pipeline_parallel.models.decoder import DecoderParts
from pipeline_parallel.models.materialize import keep_local_part
from pipeline_parallel.partition import balanced_layer_counts, estimate_costs, layer_ranges
from pipeline_parallel.schedules import SCHEDULES, Action, Kind, lower, makespan, simulate, stage_to_rank
from pipeline_parallel.stage import sparse_embedding_grad


def build_model(args) -> LlamaForCausalLM:
    config = LlamaConfig.from_preset("small", vocab_size=args.vocab, hidden_size=256, num_hidden_layers=8)
    model = LlamaForCausalLM(config)
    model.init_weights(seed=0)
    return model


def make_batch(args, vocab: int):
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, vocab, (args.batch, args.seq_len), generator=g)
    y = torch.randint(0, vocab, (args.batch, args.seq_len), generator=g)
    return x, y


class _TorchStage(nn.Module):
    """Our stage's modules as the nn.Module torch.distributed.pipelining expects; with `our_compute`,
    computing as our stages do: the first stage's embedding gradient made sparse, and the last
    stage handing its final hidden states to `_OurHeadLoss` instead of its logits to a loss."""

    def __init__(self, model: nn.Module, parts: DecoderParts, num_microbatches: int, our_compute: bool = False):
        super().__init__()
        self.model, self.parts, self.our_compute = model, parts, our_compute
        self.num_microbatches = num_microbatches

    def forward(self, x):
        with sparse_embedding_grad(self.parts.embed_tokens if self.our_compute else None):
            return self.parts.forward(x, head=not self.our_compute)

    def loss_fn(self, output, labels):
        """The loss torch's schedule calls on the last stage: the microbatch's mean over the number of
        microbatches (`num_microbatches`), the batch's mean as ours (no token is ignored), so that torch
        need not scale the gradients afterwards (`scale_grads=False`), one pass over them fewer."""
        if self.our_compute:
            return _OurHeadLoss.apply(output, labels, self.parts.lm_head, self.parts.scales,
                                      1 / (labels.numel() * self.num_microbatches))
        return F.cross_entropy(output.float().flatten(0, 1), labels.flatten()) / self.num_microbatches


class _OurHeadLoss(torch.autograd.Function):
    """Our last stage's head and loss (`HeadLoss`) as one autograd node, for torch's schedules."""

    @staticmethod
    def forward(ctx, hidden, labels, head, scales, scale):
        ctx.head_loss = HeadLoss(hidden, head, labels, scale, scales)
        return ctx.head_loss.loss

    @staticmethod
    def backward(ctx, grad_loss):
        if grad_loss.item() != 1.0:  # torch's schedule runs backward from the loss itself
            raise NotImplementedError("only a backward from the loss itself")
        ctx.head_loss.add_weight_grad()
        return ctx.head_loss.input_grad(), None, None, None, None


def worker(rank: int, world: int, port: int, args, results, parent: int) -> None:
    _end_with_parent(parent)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, PipelineStage

    base = build_model(args)
    x, y = make_batch(args, base.config.vocab_size)
    counts = balanced_layer_counts(8, world, estimate_costs(base.config, args.seq_len))
    first, last = rank == 0, rank == world - 1

    solo = [dist.new_group([r], backend="gloo") for r in range(world)][rank]  # every rank makes every group
    reference = _gradients(base, x, y)  # the single-process run's gradients, which every engine must give

    dist.barrier()
    engines, pipes = {}, {}
    # T_single: the whole model in one thread on rank 0, while the other ranks wait.
    engines["single"] = (lambda: _single_step(base, x, y)) if rank == 0 else (lambda: None)
    # The same with our engine (a Pipeline of one stage, one microbatch): our compute in one process,
    # whose ideal is the stricter one (the loss, the head's backward and the embedding gradient by our code).
    alone = pp.Pipeline(copy.deepcopy(base), num_microbatches=1, device="cpu", group=solo) if rank == 0 else None
    engines["single ours"] = (lambda: (alone.step(x, y), alone.zero_grad())) if rank == 0 else (lambda: None)
    checks = {}  # an engine's step without zeroing the gradients, and the model they are left in
    # The same on every rank at once: what one thread's step costs while every core computes, as
    # in a pipeline on a CPU (shared caches, memory bandwidth, clock). Its time is the ranks' mean.
    engines["single busy"] = lambda: _single_step(base, x, y)
    for name in args.schedules:
        pipe = pp.Pipeline(copy.deepcopy(base), schedule=name, num_microbatches=args.microbatches,
                           layer_counts=counts, device="cpu")
        engines[f"ours {name}"] = (lambda pipe=pipe: (pipe.step(x, y), pipe.zero_grad()))
        pipes[name], checks[f"ours {name}"] = pipe, (lambda pipe=pipe: pipe.step(x, y), pipe.model)
    # With --torch-with-our-compute, torch's schedules also run with our last stage's head and loss
    # and our first stage's embedding gradient, which tells the share of our time that is that
    # compute from the share that is the schedule and runtime.
    computes = {"": False, " +our compute": True} if args.torch_with_our_compute else {"": False}
    for name, cls in (("gpipe", ScheduleGPipe), ("1f1b", Schedule1F1B)):
        if name not in args.schedules:
            continue
        for suffix, ours in computes.items():
            model = copy.deepcopy(base)
            indices = layer_ranges(counts)[rank]
            keep_local_part(model, indices, first, last)
            module = _TorchStage(model, DecoderParts.of(model, indices, first, last), args.microbatches, ours)
            stage = PipelineStage(module, rank, world, torch.device("cpu"))
            schedule = cls(stage, args.microbatches, loss_fn=module.loss_fn, scale_grads=False)
            step_args, step_kwargs = _torch_step_inputs(schedule, x, y, first, last)
            engines[f"torch {name}{suffix}"] = (lambda s=schedule, m=module, a=step_args, k=step_kwargs:
                                                (s.step(*a, **k), m.zero_grad()))
            # Its first step infers shapes, running a backward of its own (whose head gradient ours
            # would add): made now, outside the check and the timing.
            engines[f"torch {name}{suffix}"]()
            checks[f"torch {name}{suffix}"] = (lambda s=schedule, a=step_args, k=step_kwargs: s.step(*a, **k), model)
    differences = {name: _gradient_difference(step, model, reference) for name, (step, model) in checks.items()}

    # Rounds over all engines, each running a short block of consecutive steps, as in training.
    # Ratios are taken within a round, between blocks a few seconds apart, so the drift of a busy
    # machine cancels out; the report gives their median over the rounds. The order is shuffled
    # each round (alike on every rank), so no engine always follows the same one.
    times = {name: [[] for _ in range(args.rounds)] for name in engines}
    # Minor page faults per step: on a CPU, memory the allocator gave back and takes again is
    # faulted in page by page, a cost that depends on what ran before as much as on the engine.
    faults = {name: [] for name in engines}
    durations = {name: [collections.defaultdict(list) for _ in range(args.rounds)] for name in pipes}
    for r in range(args.rounds):
        order = list(engines)
        random.Random(r).shuffle(order)
        for name in order:
            fn = engines[name]
            for _ in range(args.warmup):
                fn()
            for _ in range(args.steps):
                dist.barrier()
                faults_before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                start = time.perf_counter()
                fn()
                elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
                faults[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_before)
                if name == "single busy":
                    dist.all_reduce(elapsed)
                    elapsed /= world
                else:
                    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a step ends when its slowest rank does
                times[name][r].append(elapsed.item())
                if name.startswith("ours"):
                    schedule = name.split()[1]
                    for action, begin, end in pipes[schedule].last_timeline:
                        durations[schedule][r][action].append(end - begin)
    medians = {name: [{a: statistics.median(d) for a, d in per_action.items()} for per_action in rounds]
               for name, rounds in durations.items()}
    gathered = [None] * world
    dist.all_gather_object(gathered, (medians, {name: pipe.program for name, pipe in pipes.items()},
                                      {name: statistics.median(f) for name, f in faults.items()}, differences))
    if rank == 0:
        # Our compute times of each round, all ranks together, per schedule; and each rank's program.
        measured = {name: [{a: d for per_rank, *_ in gathered for a, d in per_rank[name][r].items()}
                           for r in range(args.rounds)] for name in pipes}
        programs = {name: [ran[name] for _, ran, *_ in gathered] for name in pipes}
        faults_per_rank = {name: [round(per_rank[name]) for _, _, per_rank, _ in gathered] for name in engines}
        largest = {name: max(per_rank[name] for *_, per_rank in gathered) for name in checks}
        results.put((times, counts, measured, programs, faults_per_rank, largest))
    dist.destroy_process_group()


def _end_with_parent(parent: int) -> None:
    """End this rank when the benchmark's process ends, even when killed where it cannot end its
    ranks (SIGKILL): a rank left running would load the machine for every later run. Linux only."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # no prctl: not Linux
        return
    if os.getppid() != parent:  # the parent ended before the signal was set
        os._exit(1)


def floor(program: list, world: int, measured: dict) -> float:
    """The step time `program` allows with these compute times and free transfers.

    Both engines run the same stage modules (torch's compute the dense embedding gradient and the
    head's backward under autograd, which cost more), so no engine runs this program faster.
    """
    return makespan(simulate(program, world, measured.__getitem__))


def with_whole_backwards(measured: dict, whole_b: dict[int, float]) -> dict:
    """`measured`, plus a whole backward's time (per stage in `whole_b`, else I + W) for each split
    one: the times of the same schedule with no backward split, which is what torch runs."""
    whole = {**measured}
    for a, d in measured.items():
        if a.kind == Kind.I:
            whole[Action(Kind.B, a.stage, a.mb)] = whole_b.get(a.stage, d + measured[Action(Kind.W, a.stage, a.mb)])
    return whole


def whole_backward_times(measured: dict) -> dict[int, float]:
    """Median time of a whole backward per stage, from the B actions our schedules ran unsplit."""
    per_stage = collections.defaultdict(list)
    for per_schedule in measured.values():
        for a, d in per_schedule.items():
            if a.kind == Kind.B:
                per_stage[a.stage].append(d)
    return {stage: statistics.median(d) for stage, d in per_stage.items()}


def compute_by_rank(measured: dict, world: int, m: int) -> list[float]:
    """Each rank's compute time per microbatch: the sum of its actions' `measured` times over `m`."""
    totals = [0.0] * world
    for a, d in measured.items():
        totals[stage_to_rank(a.stage, world)] += d
    return [t / m for t in totals]


def median_interval(values: list[float], confidence: float = 0.95) -> tuple[float, float]:
    """A confidence interval of the median of `values` that assumes nothing of their distribution: the
    order statistics x(k) and x(n + 1 - k) with the largest k that covers the median with at least
    `confidence` (1 - 2 P(Binomial(n, 1/2) < k)); the smallest and largest value where no k does."""
    xs, n = sorted(values), len(values)

    def coverage(k: int) -> float:
        return 1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2**n

    k = 1
    while k < (n + 1) // 2 and coverage(k + 1) >= confidence:
        k += 1
    return xs[k - 1], xs[n - k]


def _single_loss(model, x, y) -> torch.Tensor:
    """The single-process run's loss: the whole model on the whole batch, as a user would write it."""
    return F.cross_entropy(model(x).logits.float().flatten(0, 1), y.flatten())


def _single_step(model, x, y):
    _single_loss(model, x, y).backward()
    model.zero_grad()


_GRADIENT_TOLERANCE = 1e-4  # float32, summed in other orders: an engine computing something else differs by far more


def _gradients(model, x, y) -> dict[str, torch.Tensor]:
    """The single-process run's gradient of every parameter, by name."""
    _single_loss(model, x, y).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    return grads


def _gradient_difference(step, model: nn.Module, reference: dict[str, torch.Tensor]) -> float:
    """The largest difference, relative to the largest value, between the gradients one `step` of an engine
    leaves in this rank's part of `model` and the single-process run's (`reference`, by name)."""
    model.zero_grad()
    step()
    worst = max((p.grad - reference[name]).abs().max().item() / reference[name].abs().max().item()
                for name, p in model.named_parameters())
    model.zero_grad()
    return worst


def _verdict(values: list[float], of: str, bound: float, target: str) -> str:
    """The median of `values` (ratios to `of`), whether it meets `target` (at most `bound`), and where the
    interval of the median lies: wholly within the target, wholly beyond it, or across it."""
    median, (low, high) = statistics.median(values), median_interval(values)
    where = "wholly within" if high <= bound else "wholly beyond" if low > bound else "across"
    return (f"{median:.3f} of {of}, {'met' if median <= bound else 'missed'} ({target}; interval "
            f"[{low:.3f}, {high:.3f}] {where} it)")


def _torch_step_inputs(schedule, x, y, first, last) -> tuple[tuple, dict]:
    """What this rank passes to `schedule.step`, decided once, outside the timed steps."""
    args = (x,) if first else ()
    kwargs = {"target": y} if last else {}
    if last and "return_outputs" in inspect.signature(schedule.step).parameters:
        kwargs["return_outputs"] = False  # no merged outputs to make (torch 2.8 always makes them)
    return args, kwargs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=16, help="rounds over all engines")
    parser.add_argument("--schedules", type=lambda s: s.split(","), default=["gpipe", "1f1b"],
                        help="comma-separated, of gpipe and 1f1b")
    parser.add_argument("--steps", type=int, default=1, help="timed steps per engine per round")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps before each block")
    parser.add_argument("--torch-with-our-compute", action="store_true",
                        help="also run torch's schedules with our last stage's head and loss (loss.HeadLoss) "
                             "as their loss_fn and our first stage's sparse embedding gradient")
    args = parser.parse_args()
    if not args.schedules or set(args.schedules) - {"gpipe", "1f1b"}:
        parser.error(f"--schedules takes gpipe, 1f1b or both (comma-separated), not {','.join(args.schedules)}")
    for name in ("ranks", "microbatches", "batch", "seq_len", "vocab", "rounds", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, not {getattr(args, name)}")
    if args.warmup < 0:
        parser.error(f"--warmup must be at least 0, not {args.warmup}")
    if args.ranks > 8:
        parser.error(f"--ranks {args.ranks}: the model has 8 layers, and every stage needs one")
    if args.batch % args.microbatches:
        parser.error(f"--batch {args.batch} does not split into --microbatches {args.microbatches} equal microbatches")

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, args.ranks, port, args, results, os.getpid())) for r in range(args.ranks)]
    for p in procs:
        p.start()
    while True:  # a rank that fails prints its traceback and ends; then end the others rather than wait forever
        try:
            times, counts, measured, programs, faults, differences = results.get(timeout=1.0)
            break
        except queue.Empty:
            failed = [rank for rank, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if failed:
                for p in procs:
                    p.kill()
                sys.exit(f"rank(s) {', '.join(map(str, failed))} failed (the first error above is the cause); "
                         "the benchmark stopped")
    for p in procs:
        p.join()

    unlike = {name: d for name, d in differences.items() if d > _GRADIENT_TOLERANCE}
    if unlike:  # times of engines that do not compute the same thing would mean nothing
        sys.exit(f"the gradients of {', '.join(unlike)} differ from the single-process run's by up to "
                 f"{max(unlike.values()):.1e} of the largest, more than {_GRADIENT_TOLERANCE:.0e}: the benchmark stopped")
    p, m = args.ranks, args.microbatches
    per_round = {name: [statistics.median(t) for t in rounds] for name, rounds in times.items()}
    best = {name: min(min(t) for t in rounds) for name, rounds in times.items()}  # the least disturbed step
    single, single_busy = per_round.pop("single"), per_round.pop("single busy")  # T_single per round
    single_ours = per_round.pop("single ours")
    best.pop("single ours")

    def ideal_of(t_single: float) -> float:
        """The bubble-bound ideal step time of the issue's target, from a single-process step time."""
        return t_single / p * (m + p - 1) / m

    ideal, busy_ideal = [ideal_of(t) for t in single], [ideal_of(t) for t in single_busy]
    ours_ideal = [ideal_of(t) for t in single_ours]
    best_ideal = ideal_of(best.pop("single"))
    best.pop("single busy")
    floors = {name: [floor(programs[name], p, d) for d in rounds] for name, rounds in measured.items()}
    # Whole backwards timed in the same round (1F1B runs its steady state unsplit on every stage).
    whole_b = [whole_backward_times({name: rounds[r] for name, rounds in measured.items()}) for r in range(args.rounds)]
    whole = {name: [floor(lower(SCHEDULES[name](p, m), p), p, with_whole_backwards(d, whole_b[r]))
                    for r, d in enumerate(rounds)] for name, rounds in measured.items()}
    # Each rank's compute per microbatch: its largest sets a schedule's pace; their total against
    # T_single is what running in stages costs on this machine beyond the bubble (shared cores, splits).
    per_rank = {name: [compute_by_rank(d, p, m) for d in rounds] for name, rounds in measured.items()}
    med = statistics.median

    def ratios(a, b):
        return [x / y for x, y in zip(a, b)]

    print(f"Llama 8 layers, hidden 256, vocab {args.vocab}; batch {args.batch} x seq {args.seq_len}; "
          f"{p} ranks (layers per stage {counts}), {m} microbatches, 1 thread per rank, gloo; "
          f"{args.rounds} rounds of {args.steps} steps per engine")
    print(f"single process, 1 thread: {med(single) * 1e3:8.1f} ms/step; with one on every "
          f"rank at once: {med(single_busy) * 1e3:.1f} ms/step "
          f"(x{med([b / i for b, i in zip(busy_ideal, ideal)]):.3f}: this machine's cost of all cores computing)")
    print(f"single process, 1 thread, our engine (one stage, one microbatch): {med(single_ours) * 1e3:.1f} ms/step "
          f"(x{med(ratios(single_ours, single)):.3f} of the plain step: our loss, head backward and embedding gradient)")
    print(f"bubble-bound ideal      : {med(ideal) * 1e3:8.1f} ms/step  (T_single / p * (m + p - 1) / m); "
          f"with the all-cores T_single ('vs busy ideal'): {med(busy_ideal) * 1e3:.1f}; with our engine's "
          f"T_single: {med(ours_ideal) * 1e3:.1f}")
    print("gradients against the single-process run's (largest difference over the largest value): " +
          ", ".join(f"{name} {d:.1e}" for name, d in differences.items()))
    for name in floors:
        split = [sum(a.kind == Kind.I for a in program) for program in programs[name]]
        print(f"floor of our {name:<6}   : {med(floors[name]) * 1e3:8.1f} ms/step  (with whole backwards, as torch's "
              f"schedule runs it: {med(whole[name]) * 1e3:.1f}); our measured compute times, free transfers; "
              f"split backwards per rank {split} of {m}")
        ranks = [med(c[rank] for c in per_rank[name]) for rank in range(p)]
        print(f"  compute per microbatch by rank: {[round(c * 1e3, 1) for c in ranks]} ms (the largest "
              f"{med(max(c) / statistics.mean(c) for c in per_rank[name]):.3f}x their mean; all ranks' compute "
              f"{med(sum(c) * m / t for c, t in zip(per_rank[name], single)):.3f}x T_single)")
    print("ratios: median over rounds [95% confidence interval of that median]; 'best': each engine's fastest "
          "step against the others'")
    width = max(map(len, per_round))
    print(f"{'engine':<{width}} {'ms/step':>8}  {'vs torch':<21} {'vs ideal':<21} {'vs busy ideal':<21} "
          f"{'vs floor':<21} {'best ms':>8} {'vs torch':>8} {'vs ideal':>8}  page faults/step by rank")

    def ratio(a, b):
        values = ratios(a, b)
        low, high = median_interval(values)
        return f"{med(values):.3f} [{low:.3f}, {high:.3f}]"

    for name, t in per_round.items():
        schedule = name.split()[1]
        vs_floor = ratio(t, floors[schedule]) if name.startswith("ours") else "-"
        print(f"{name:<{width}} {med(t) * 1e3:8.1f}  {ratio(t, per_round['torch ' + schedule]):<21} "
              f"{ratio(t, ideal):<21} {ratio(t, busy_ideal):<21} {vs_floor:<21} {best[name] * 1e3:8.1f} "
              f"{best[name] / best['torch ' + schedule]:8.3f} {best[name] / best_ideal:8.3f}  {faults[name]}")
    print(f"single-process page faults/step by rank: {faults['single']} (one thread), {faults['single busy']} (all)")
    for name, t in per_round.items():  # the targets, on the medians over rounds and their intervals
        if name.startswith("ours"):
            vs_torch, vs_ideal = ratios(t, per_round["torch " + name.split()[1]]), ratios(t, ideal)
            print(f"target {name}: {_verdict(vs_torch, 'torch', 0.95, 'at most 0.95')}; "
                  f"{_verdict(vs_ideal, 'the ideal', 1.10, 'within 10%')}; {med(ratios(t, ours_ideal)):.3f} of the "
                  "ideal from our engine's T_single")


if __name__ == "__main__":
    main()
