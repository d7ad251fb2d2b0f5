"""Train a small Llama with `Pipeline` and check every step against one process on the full batch.

    torchrun --nproc-per-node 2 examples/pipeline_demo.py [--schedule 1f1b] [--steps 10]

Each rank also keeps a full copy of the model and trains it alone on the same batches; after
every step it compares the loss and, for the parameters its stage owns, the gradients. Plain
SGD keeps the two runs' weights together; Adam would magnify float rounding (it normalises each
gradient) until the runs drift apart over many steps, although each step's gradients agree.
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F

import pipeline_parallel as pp
from pipeline_parallel.models import LlamaConfig, LlamaForCausalLM


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--schedule", default="1f1b", choices=["1f1b", "gpipe"])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--microbatches", type=int, default=4)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    model = LlamaForCausalLM(LlamaConfig.from_preset("tiny", vocab_size=512, num_hidden_layers=6))
    model.init_weights(seed=0)
    reference = copy.deepcopy(model)
    pipe = pp.Pipeline(model, schedule=args.schedule, num_microbatches=args.microbatches, device="cpu")
    optimizer = torch.optim.SGD(pipe.parameters(), lr=1.0)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=1.0)
    ref_params = dict(reference.named_parameters())
    if rank == 0:
        print(f"{dist.get_world_size()} ranks, layers per stage {pipe.layer_counts}, schedule {args.schedule}")

    generator = torch.Generator().manual_seed(0)
    for step in range(args.steps):
        start = torch.randint(0, 512, (8, 1), generator=generator)
        x = (start + torch.arange(64)) % 512  # counting sequences: a pattern worth learning
        y = (x + 1) % 512
        y[torch.arange(64) < torch.arange(8)[:, None]] = -100  # row i ignores i tokens: microbatches differ in count
        loss = pipe.step(x, y)
        pipe.clip_grad_norm_(1.0)

        ref_loss = F.cross_entropy(reference(x).logits.flatten(0, 1), y.flatten(), ignore_index=-100)
        ref_loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        grad_error = max((p.grad - ref_params[name].grad).abs().max().item() for name, p in pipe.named_parameters())
        errors = torch.tensor([abs(loss - ref_loss.item()), grad_error])
        dist.all_reduce(errors, op=dist.ReduceOp.MAX)
        for opt in (optimizer, ref_optimizer):
            opt.step()
            opt.zero_grad(set_to_none=True)
        if rank == 0:
            verdict = "matches" if errors.max() < 1e-5 else "DIFFERS from"
            print(f"step {step}: pipeline loss {loss:.6f}, single process {ref_loss.item():.6f}; "
                  f"max grad difference {errors[1]:.1e}: {verdict} the single-process run")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
