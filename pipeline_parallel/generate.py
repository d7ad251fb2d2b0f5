"""Sample text from a training run, a checkpoint, or an exported Hugging Face model.

    python -m pipeline_parallel.generate runs/tiny --prompt "def" --max-new-tokens 200
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch import nn

from ._checks import check_int, check_seed, is_utf8
from .checkpoint import is_checkpoint
from .export import HF_CONFIG, export_tokenizer, load_full_model
from .models import generate
from .models.families import hf_float32
from .tokenizer import Tokenizer


def load_model(path: str | Path) -> tuple[nn.Module, Tokenizer]:
    """An exported model directory (config.json + safetensors), or a run / checkpoint directory; with the
    tokenizer it was trained or exported with (another is refused before the model loads)."""
    path = Path(path)
    if (path / HF_CONFIG).is_file() and not is_checkpoint(path):
        import transformers

        tokenizer = export_tokenizer(path)
        model = transformers.AutoModelForCausalLM.from_pretrained(path, **hf_float32(), local_files_only=True)
        return model.eval(), tokenizer
    return load_full_model(path)


def _check_prompt(prompt: str) -> None:
    """Refuse a prompt no tokenizer takes: bytes typed in another encoding (surrogate escapes)."""
    if not is_utf8(prompt):
        raise ValueError("prompt is not valid UTF-8 text (typed in another encoding?); give it in UTF-8")


def sample(model: nn.Module, tokenizer: Tokenizer, prompt: str = "", max_new_tokens: int = 200,
           temperature: float = 0.8, top_k: int | None = 50, seed: int = 0) -> str:
    """`prompt` followed by `max_new_tokens` sampled tokens, as text (an empty prompt starts a document),
    fewer where the model ends the text (its end-of-text token ends the sample and is not shown).

    The new tokens are decoded together with the prompt's and the prompt's own text cut off:
    decoded alone, they would lose what their joint with the prompt makes, such as the space
    a SentencePiece decoder strips from the start of a text ("Hello" + "▁world").
    """
    _check_prompt(prompt)
    # Checked here, not left to torch: a float top_k or a seed beyond 64 bits failed in torch.topk or manual_seed
    # (generate checks max_new_tokens and temperature; its top_k takes None, not 0, for all tokens).
    if top_k is not None:
        check_int("top_k", top_k, 0, hint=" (0 or None: sample among all tokens)")
    check_seed("seed", seed)
    prompt_ids = tokenizer.encode(prompt)
    ids = tokenizer.document_ends[0] + prompt_ids or [tokenizer.eos_id]  # as a document starts in training
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)  # on the model's device, or torch ignores it
    out = generate(model, torch.tensor([ids], device=device), max_new_tokens, temperature=temperature,
                   top_k=top_k or None, generator=generator, vocab_size=tokenizer.vocab_size, eos_id=tokenizer.eos_id)
    new = out[0, len(ids):].tolist()
    if new[-1:] == [tokenizer.eos_id]:  # the end of the text: ends the sample, not shown
        new.pop()
    head, whole = tokenizer.decode(prompt_ids), tokenizer.decode(prompt_ids + new)
    # A prompt that ends inside a character (byte-level BPE) decodes apart from the whole: then the new tokens alone.
    return prompt + (whole[len(head):] if whole.startswith(head) else tokenizer.decode(new))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="pipeline_parallel.generate", description=__doc__.split("\n")[0])
    parser.add_argument("path", help="exported model directory, run directory or checkpoint directory")
    parser.add_argument("--prompt", default="", help="text to continue (default: start a new document)")
    parser.add_argument("--max-new-tokens", type=int, default=200, help="tokens to add to each sample (default: %(default)s)")
    parser.add_argument("--temperature", type=float, default=0.8, help="0 picks the most likely token (default: %(default)s)")
    parser.add_argument("--top-k", type=int, default=50, help="sample among the k most likely tokens; 0: all (default: %(default)s)")
    parser.add_argument("--num-samples", type=int, default=1, help="samples to print (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="sample i is drawn with seed + i (default: %(default)s)")
    args = parser.parse_args(argv)
    for name, lowest in (("temperature", 0), ("top_k", 0), ("max_new_tokens", 0), ("num_samples", 1), ("seed", 0)):
        if not getattr(args, name) >= lowest:
            parser.error(f"--{name.replace('_', '-')} must be >= {lowest}, got {getattr(args, name)}")
    if args.seed + args.num_samples > 2**63:  # sample i takes seed + i; torch's generators take less than 2**63
        parser.error(f"--seed must be below 2**63 - --num-samples, got {args.seed}")
    try:
        _check_prompt(args.prompt)  # before the model loads
    except ValueError as e:
        parser.error(f"--{e}")
    try:
        try:
            model, tokenizer = load_model(args.path)
        except (OSError, ValueError) as e:  # nothing loadable there
            parser.exit(2, f"error: {e}\n")
        for i in range(args.num_samples):
            if args.num_samples > 1:
                print(f"--- sample {i + 1}")
            print(sample(model, tokenizer, args.prompt, args.max_new_tokens, args.temperature, args.top_k,
                         args.seed + i))
    except KeyboardInterrupt:  # Ctrl-C is how a user ends a long sample: no traceback for it
        parser.exit(130, "interrupted\n")


if __name__ == "__main__":
    main()
