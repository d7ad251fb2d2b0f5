"""Step time of our GPipe and 1F1B against torch.distributed.pipelining on the same stages and data.

    python benchmarks/bench_vs_torch.py [--ranks 2] [--microbatches 8] [--rounds 3] [--steps 4]

CPU, gloo, one thread per rank. Every rank builds the same Llama (8 layers, hidden 256) and
keeps the same stage for both engines (our cost-balanced split); a single-process run with one
thread gives T_single. Each engine runs blocks of consecutive steps, as in training, and the
blocks rotate over several rounds, so drift on a busy machine hits all of them alike. Prints each engine's median step time, the ratio to torch's equivalent,
and the ratio to the bubble-bound ideal T_single / p * (m + p - 1) / m.
"""

from __future__ import annotations

import argparse
import collections
import copy
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

import pipeline_parallel as pp
from pipeline_parallel.models import LlamaConfig, LlamaForCausalLM
from pipeline_parallel.models.decoder import DecoderParts, keep_local_part
from pipeline_parallel.partition import balanced_layer_counts, estimate_costs, layer_ranges
from pipeline_parallel.schedules import build_schedule, makespan, simulate


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
    """Our stage's modules as the nn.Module torch.distributed.pipelining expects."""

    def __init__(self, model: nn.Module, parts: DecoderParts):
        super().__init__()
        self.model, self.parts = model, parts

    def forward(self, x):
        return self.parts.forward(x)


def _torch_loss(logits, labels):
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def worker(rank: int, world: int, port: int, args, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, PipelineStage

    base = build_model(args)
    x, y = make_batch(args, base.config.vocab_size)
    counts = balanced_layer_counts(8, world, estimate_costs(base.config, args.seq_len))
    first, last = rank == 0, rank == world - 1

    dist.barrier()
    engines, pipes = {}, {}
    # T_single: the whole model in one thread on rank 0, while the other ranks wait.
    engines["single"] = (lambda: _single_step(base, x, y)) if rank == 0 else (lambda: None)
    for name in ("gpipe", "1f1b"):
        pipe = pp.Pipeline(copy.deepcopy(base), schedule=name, num_microbatches=args.microbatches,
                           layer_counts=counts, device="cpu")
        engines[f"ours {name}"] = (lambda pipe=pipe: (pipe.step(x, y), pipe.zero_grad()))
        pipes[name] = pipe
    for name, cls in (("gpipe", ScheduleGPipe), ("1f1b", Schedule1F1B)):
        model = copy.deepcopy(base)
        indices = layer_ranges(counts)[rank]
        keep_local_part(model, indices, first, last)
        module = _TorchStage(model, DecoderParts.of(model, indices, first, last))
        stage = PipelineStage(module, rank, world, torch.device("cpu"))
        schedule = cls(stage, args.microbatches, loss_fn=_torch_loss)
        engines[f"torch {name}"] = (lambda s=schedule, m=module: (_torch_step(s, x, y, first, last), m.zero_grad()))

    times = {name: [] for name in engines}
    durations = {name: collections.defaultdict(list) for name in pipes}  # our compute times per action
    for _ in range(args.rounds):  # blocks of consecutive steps, as in training; rotating engines
        for name, fn in engines.items():
            for _ in range(args.warmup):
                fn()
            for _ in range(args.steps):
                dist.barrier()
                start = time.perf_counter()
                fn()
                elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a step ends when its slowest rank does
                times[name].append(elapsed.item())
                if name.startswith("ours"):
                    for action, start, end in pipes[name.split()[1]].last_timeline:
                        durations[name.split()[1]][action].append(end - start)
    # The floor of each schedule: its step time with the compute times measured in our run and free
    # transfers. Both engines run the same stage modules, so no engine can run that schedule faster.
    medians = {name: {a: statistics.median(d) for a, d in per_action.items()} for name, per_action in durations.items()}
    gathered = [None] * world
    dist.all_gather_object(gathered, medians)
    if rank == 0:
        floors = {}
        for name in pipes:
            measured = {a: d for per_rank in gathered for a, d in per_rank[name].items()}
            floors[name] = makespan(simulate(build_schedule(name, world, args.microbatches), world, measured.__getitem__))
        medians = {name: statistics.median(t) for name, t in times.items()}
        results.put((medians.pop("single"), medians, counts, floors))
    dist.destroy_process_group()


def _single_step(model, x, y):
    loss = F.cross_entropy(model(x).logits.float().flatten(0, 1), y.flatten())
    loss.backward()
    model.zero_grad()


def _torch_step(schedule, x, y, first, last):
    if first and last:
        schedule.step(x, target=y, return_outputs=False)
    elif first:
        schedule.step(x)
    elif last:
        schedule.step(target=y, return_outputs=False)
    else:
        schedule.step()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=3, help="rounds over all engines")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per engine per round")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps before each block")
    args = parser.parse_args()

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, args.ranks, port, args, results)) for r in range(args.ranks)]
    for p in procs:
        p.start()
    single, medians, counts, floors = results.get()
    for p in procs:
        p.join()

    p, m = args.ranks, args.microbatches
    ideal = single / p * (m + p - 1) / m
    print(f"Llama 8 layers, hidden 256, vocab {args.vocab}; batch {args.batch} x seq {args.seq_len}; "
          f"{p} ranks (layers per stage {counts}), {m} microbatches, 1 thread per rank, gloo")
    print(f"single process, 1 thread: {single * 1e3:8.1f} ms/step")
    print(f"bubble-bound ideal      : {ideal * 1e3:8.1f} ms/step  (T_single / p * (m + p - 1) / m)")
    for name, floor in floors.items():
        print(f"{name} floor{'':<{13 - len(name)}}: {floor * 1e3:8.1f} ms/step  (this schedule with our measured "
              "compute times and free transfers)")
    print(f"{'engine':<12} {'ms/step':>9} {'vs torch':>9} {'vs ideal':>9} {'vs floor':>9}")
    for name, t in medians.items():
        schedule = name.split()[1]
        torch_t = medians["torch " + schedule]
        print(f"{name:<12} {t * 1e3:9.1f} {t / torch_t:9.3f} {t / ideal:9.3f} {t / floors[schedule]:9.3f}")


if __name__ == "__main__":
    main()
