"""What a finished run leaves besides its checkpoint: the loss curve, the Hugging Face export and a sample.

Made on the reporting rank from the saved files alone. Each that cannot be made says why in one line, and
how to make it later: the training stands, saved."""

from __future__ import annotations

from pathlib import Path

from tqdm import tqdm

from ._files import room_note
from .checkpoint import DamagedCheckpointError
from .config import Config
from .export import EXPORT_DIR, export, export_command
from .generate import sample
from .metrics import PLOT_FILE, plot_loss


def report_run_end(cfg: Config, metrics_path: Path, checkpoint: Path, group) -> None:
    """Draw the loss curve, name the last checkpoint, then export it into run_dir/export and print a sample
    (as `cfg` asks); `group` holds this rank alone, to load the whole model in."""
    run_dir = Path(cfg.run_dir)
    if cfg.log.plot:
        try:
            how = plot_loss(metrics_path, run_dir / PLOT_FILE)
            tqdm.write(f"loss curve ({how}): {run_dir / PLOT_FILE}")
        except OSError as e:  # a full disk: the export may still fit
            tqdm.write(f"loss curve not drawn: {e}{room_note(run_dir)}")
    tqdm.write(f"checkpoint: {checkpoint}")
    if not cfg.export.at_end:
        return
    try:
        out, model, tok = export(checkpoint, run_dir / EXPORT_DIR, cfg.export.dtype, group=group)
    except DamagedCheckpointError as e:  # since it was saved: the command to export the intact one it names
        again = e.advising(lambda earlier: "export an earlier one with: "
                                           f"{export_command(earlier, 'DIR', cfg.export.dtype)}")
        tqdm.write(f"export skipped: {again}")
        return
    except (FileExistsError, ValueError) as e:  # files come, or the run's tokenizer replaced, since the start
        tqdm.write(f"export skipped: {e}. Export the checkpoint with: "
                   f"{export_command(checkpoint, 'DIR', cfg.export.dtype)}")
        return
    except OSError as e:  # a full disk, a directory made read-only
        tqdm.write(f"export failed: {e}; the training is saved: make room or fix the directory, then export the "
                   f"checkpoint with: {export_command(checkpoint, dtype=cfg.export.dtype)}")
        return
    tqdm.write(f"Hugging Face model: {out}")
    if cfg.export.sample_tokens:
        text = sample(model, tok, cfg.export.prompt, cfg.export.sample_tokens, cfg.export.temperature,
                      cfg.export.top_k, cfg.seed)
        tqdm.write(f"sample:\n{text}")
