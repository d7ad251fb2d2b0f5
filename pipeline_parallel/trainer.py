"""The Trainer: builds this rank's stage, data and optimizer (resuming if asked), then trains, evaluates and
checkpoints on schedule, and ends with run_end's report."""

from __future__ import annotations

import contextlib
import math
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from ._checks import plural
from ._dir_lock import DirectoryInUse, lock_dir, unlock_dir
from ._files import atomic_write, room_note
from .batch import differences
from .checkpoint import load_checkpoint, published, read_extra, save_checkpoint
from .comm import PipeComm
from .config import CONFIG_FILE, Config, ConfigError, as_config_error, settings, to_toml
from .config_checks import check_config, llama_config
from .data import TokenBatches, eval_batches, prepare_data
from .export import EXPORT_DIR, check_replaceable, hf_config_dict, keep_run_tokenizer
from .hf_weights import check_hf_weights, load_hf_buffers, load_hf_weights
from .launch import join_group, setup_device, stop_asked, world_size
from .metrics import MetricsLogger, bubble_fraction
from .models import LlamaForCausalLM, num_parameters
from .models.families import check_layout
from .models.materialize import hf_model_on_meta
from .optim import build_optimizer, lr_at, scale_grads_, set_hyperparameters, set_lr
from .pipeline import Pipeline
from .resume import as_resume_error, check_resumable, checkpoint_to_resume
from .run_end import report_run_end
from .tokenizer_identity import tokenizer_record


def build_model(cfg: Config, vocab_size: int) -> torch.nn.Module:
    """The full model on the meta device (no memory): our Llama, or the architecture of --hf-model."""
    if not cfg.hf_model:
        with torch.device("meta"):
            return LlamaForCausalLM(llama_config(cfg, vocab_size))
    import transformers

    return hf_model_on_meta(transformers.AutoConfig.from_pretrained(cfg.hf_model, local_files_only=True))


_DATA_FAULTS = (ValueError, OSError, ImportError)  # what bad data, paths or settings raise while reading


def _given_tokenizer(cfg: Config) -> str | None:
    """The tokenizer the run is given (data.tokenizer, else the --hf-model's own); None: one trained in run_dir."""
    return cfg.data.tokenizer or cfg.hf_model or None


# How long ranks wait for one of them to prepare the data or export the model: those take as long as
# the corpus or the model is big, far beyond a process group's timeout (30 min on gloo, 10 on NCCL),
# and a rank that dies on the way still ends the job through torchrun.
_PATIENCE = timedelta(hours=24)


def _check_same_settings(cfg: Config, comm: PipeComm) -> None:
    """Refuse ranks started with different settings: they would hang (max_steps) or silently disagree (lr)."""
    differ = differences(comm.all_gather_object(settings(cfg)))
    if differ:
        raise ConfigError(f"the ranks were started with different settings: {differ}; launch every rank with "
                          "the same config file and overrides")


@contextlib.contextmanager
def _stopped_if_asked():
    """A checkpoint's save or load that fails once a stop signal came ends as that stop: torch's file writer, for one,
    turns the exception the signal raised in its write into an error of its own, which would blame the disk or call a
    sound checkpoint damaged."""
    try:
        yield
    except Exception as e:
        stop = stop_asked()
        if stop is None:
            raise
        raise stop from e


class TrainingDiverged(RuntimeError):
    """The loss or the gradients stopped being finite (raised before the update), or the weights after an
    update did (raised before they are saved); on every rank."""


class CheckpointNotSaved(RuntimeError):
    """A checkpoint could not be written (the earlier ones are untouched); on every rank."""


class Trainer:
    """Builds this rank's stage, data and optimizer (resuming if asked), then trains with `fit()`."""

    def __init__(self, cfg: Config):
        self.owns_group = join_group(cfg)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.cfg, self.run_dir = cfg, Path(cfg.run_dir)
        self.trained = False  # all steps done and saved: what is left is finish()
        # Waits on one rank's long work (data, export) go through a group of their own with a long timeout.
        self._patient = PipeComm(dist.new_group(backend="gloo", timeout=_PATIENCE) if dist.is_initialized() else None)
        _check_same_settings(cfg, self._patient)  # first: then every later error is raised alike on every rank
        resume_from = self._agreed(self._preflight, "checking the settings", faults=(ConfigError,))
        self.device = setup_device(cfg)
        self.say(f"resolved config:\n{to_toml(cfg)}")

        tokenizer = _given_tokenizer(cfg)
        self.data = self._agreed(lambda: prepare_data(
            self.run_dir, cfg.data.path or None, seq_len=cfg.data.seq_len, tokenizer=tokenizer,
            vocab_size=cfg.data.vocab_size, text_field=cfg.data.text_field, max_tokens=cfg.data.max_tokens or None,
            eval_fraction=cfg.data.eval_fraction, tokenizer_train_chars=cfg.data.tokenizer_train_chars),
            "preparing the data", faults=_DATA_FAULTS, prefix="data: ", rank0_first=True)
        digests = self._patient.all_gather_object(self.data.digest)  # each rank read the files itself
        if len(set(digests)) > 1:
            raise ConfigError("the ranks read different data (token streams " + ", ".join(
                f"{digest[:12]} on rank {rank}" for rank, digest in enumerate(digests)) + "): a data file changed "
                "while it was read, or the nodes' copies differ; give every rank the same files and start again")
        tok = self.data.tokenizer
        model = build_model(cfg, tok.vocab_size)
        if tok.vocab_size > model.config.vocab_size:
            where = f"{cfg.hf_model}'s config.json has vocab_size" if cfg.hf_model else "model.vocab_size is"
            raise ConfigError(f"the tokenizer has {tok.vocab_size} tokens but {where} {model.config.vocab_size}, so "
                              "some token IDs would have no embedding row: give the model's own tokenizer (or a "
                              "smaller one)" + ("" if cfg.hf_model else ", or leave model.vocab_size unset to take "
                                                "the tokenizer's"))
        self.model_config = hf_config_dict(model, tok.eos_id, tok.bos_id)
        self.say(f"model: {num_parameters(model):,} parameters, {self.model_config['num_hidden_layers']} layers; data: "
                 f"{len(self.data.train):,} train and {len(self.data.eval):,} held-out sequences of "
                 f"{cfg.data.seq_len} tokens, vocabulary {tok.vocab_size:,}")

        if cfg.hf_model:  # before the pipeline makes what no file gives: its own weights are loaded once it is built
            load_hf_buffers(model, cfg.hf_model)
        autocast = torch.bfloat16 if cfg.train.dtype == "bf16" else None
        self.pipe = Pipeline(model, cfg.pipeline.schedule, cfg.pipeline.num_microbatches,
                             layer_counts=cfg.pipeline.layer_counts or None, device=self.device,
                             autocast_dtype=autocast, seed=cfg.seed, seq_len=cfg.data.seq_len,
                             recompute=cfg.pipeline.recompute)
        self.say(f"pipeline: {plural(self.pipe.pp_size, 'stage')}, layers per stage {self.pipe.layer_counts}, "
                 f"schedule {self.pipe.schedule}, microbatches per step {self.pipe.num_microbatches}")
        self.optimizer = build_optimizer(self.pipe.model, cfg.optim)
        with as_config_error("train.batch_size"):  # the same data on every rank, so the same outcome
            self.batches = TokenBatches(self.data.train, cfg.train.batch_size, cfg.seed, accum_steps=cfg.train.grad_accum_steps,
                                        need_inputs=self.pipe.is_first, need_labels=self.pipe.is_last)
        self.step, self.tokens, self.checkpoint = 0, 0, None
        self._busy_seconds = self._pipeline_seconds = 0.0  # this rank's, since the last measured_idle_fraction()
        self._resume_or_start(resume_from)
        self.reporter = self.pipe.is_last  # knows the loss first; shows the bar and writes the metrics
        self.metrics = self._agreed(  # a damaged metrics file is one line on every rank, not a rank that stops alone
            lambda: MetricsLogger(self.run_dir, self.step, cfg.log.tensorboard) if self.reporter else None,
            "opening the metrics file", faults=(ValueError, OSError))

    def say(self, message: str, rank: int = 0) -> None:
        if self.rank == rank:
            tqdm.write(message)

    def _preflight(self) -> Path | None:
        """Check the settings and the files they name, before any long work; return the checkpoint to
        resume from (None: step 0). Every rank checks: each node may see other files."""
        cfg = self.cfg
        check_config(cfg, world_size())
        try:  # every rank writes its checkpoint shards there: found now, not after the data is prepared
            self.run_dir.mkdir(parents=True, exist_ok=True)
            tempfile.TemporaryFile(dir=self.run_dir).close()
        except OSError as e:
            raise ConfigError(f"run_dir {self.run_dir} cannot be written: {e.strerror or e}") from None
        if self.rank == 0:  # one run per directory, until finish(); before the checkpoints are looked at
            try:
                lock_dir(self.run_dir)
            except DirectoryInUse as e:
                raise ConfigError(f"run_dir {e}: two runs in one directory would overwrite each other's checkpoints "
                                  "and metrics; wait for that run to end (or stop it), or give another run_dir") from None
        resume_from = checkpoint_to_resume(cfg)  # before the data: a wrong resume is a config error
        if cfg.export.at_end:  # found now, not after the whole run has trained
            with as_config_error("export.at_end", FileExistsError):
                check_replaceable(self.run_dir / EXPORT_DIR, cfg.hf_model)
        if cfg.hf_model:  # a model the pipeline cannot run or load is found now, not after the data is prepared
            with as_config_error("hf_model", TypeError, ValueError, FileNotFoundError):
                check_layout(model := build_model(cfg, vocab_size=0))
                check_hf_weights(model, cfg.hf_model)
        return resume_from

    def _agreed(self, fn, what: str, faults: tuple[type[Exception], ...], prefix: str = "",
                rank0_first: bool = False):
        """Run `fn` on every rank (with `rank0_first`, on rank 0 and then on the others, which reuse what
        it cached) and raise its first failure on every rank, so that no rank goes on to wait for one
        that stopped, and the error is printed even when rank 0 did not fail.

        One of `faults` (a bad setting, file or text) becomes one ConfigError with the same message
        everywhere, naming the rank it happened on unless that is rank 0; anything else is raised as
        itself where it happened and as a RuntimeError naming `what` and that rank elsewhere.
        """
        result = None
        for turn in (True, False) if rank0_first else (None,):
            error = None
            if turn is None or (self.rank == 0) == turn:
                try:
                    result = fn()
                except Exception as e:
                    error = e
            reports = self._patient.all_gather_object(None if error is None else (isinstance(error, faults), str(error)))
            failed = [(rank, *report) for rank, report in enumerate(reports) if report is not None]
            if failed:
                rank, is_fault, message = failed[0]
                if is_fault:
                    raise ConfigError(f"{prefix}{message}" if rank == 0 else f"rank {rank}: {prefix}{message}") from error
                raise error or RuntimeError(f"rank {rank} failed {what}: {message}")
        return result

    def _resume_or_start(self, path: Path | None) -> None:
        cfg = self.cfg
        if path is not None:
            self._resume(path)
        elif cfg.hf_model:
            load_hf_weights(self.pipe.model, cfg.hf_model)

        def record_start() -> None:  # only once the checkpoint was accepted: a refused resume leaves the run as it was
            if self.rank != 0:
                return
            try:
                atomic_write(self.run_dir / CONFIG_FILE, to_toml(cfg))
                keep_run_tokenizer(self.run_dir, self.data.tokenizer if _given_tokenizer(cfg) else None)
            except OSError as e:
                raise OSError(f"could not write the run's settings into {self.run_dir} ({e.strerror or e}"
                              f"{room_note(self.run_dir)}); make room or fix the directory") from e

        self._agreed(record_start, "recording the start", faults=(OSError,))

    def _resume(self, path: Path) -> None:
        """Load `path` after checking it was trained on this model, tokenizer and data."""
        with as_resume_error():
            extra = read_extra(path)
        check_resumable(path, extra, self.model_config, self.data)
        with as_config_error(str(path)):
            self.batches.load_state_dict(extra["data"])
        with as_resume_error(), _stopped_if_asked():  # its files are compared with their record first
            load_checkpoint(path, self.pipe.model, self.optimizer)
        set_hyperparameters(self.optimizer, self.cfg.optim)  # the config's, not the checkpoint's
        self.step, self.tokens, self.checkpoint = extra["step"], extra["tokens"], path
        self.say(f"resumed from {path} at step {self.step}")

    def train_step(self) -> dict:
        """One optimizer step over grad_accum_steps pipeline steps; returns its metrics."""
        cfg = self.cfg
        lr = lr_at(self.step, cfg.optim, cfg.train.max_steps)
        set_lr(self.optimizer, lr)
        accum, loss = cfg.train.grad_accum_steps, 0.0
        for _ in range(accum):
            inputs, labels = next(self.batches)
            loss += self.pipe.step(inputs, labels) / accum  # each step: token mean of its own batch
            self._pipeline_seconds += self.pipe.last_step_seconds
            self._busy_seconds += sum(end - start for _, start, end in self.pipe.last_timeline)
        scale_grads_(self.pipe.parameters(), 1.0 / accum)
        grad_norm = self.pipe.clip_grad_norm_(cfg.optim.grad_clip or math.inf).item()
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):  # the same numbers on every rank
            self.pipe.zero_grad()
            raise self._diverged(f"step {self.step + 1}: loss {loss}, gradient norm {grad_norm}; the weights were "
                                 "not updated and nothing was saved")
        self.optimizer.step()
        self.pipe.zero_grad()
        self.step += 1
        self.tokens += _accum_tokens(cfg)
        return {"step": self.step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens": self.tokens}

    def measured_idle_fraction(self) -> float:
        """The share of the pipeline steps' time since the last call that the ranks spent idle, all
        ranks together (one all-reduce, so every rank calls it). Unlike `bubble_fraction` it includes
        uneven stages and waits on transfers."""
        seconds = torch.tensor([self._busy_seconds, self._pipeline_seconds], dtype=torch.float64,
                               device=self.pipe.device)
        busy, total = self.pipe.comm.all_reduce(seconds).tolist()
        self._busy_seconds = self._pipeline_seconds = 0.0
        return 1.0 - busy / total if total > 0 else 0.0

    def evaluate(self) -> float:
        """Token-mean loss over (up to max_batches) held-out batches; a last smaller batch is padded
        with ignored rows and weighs by its own sequences."""
        total = count = 0
        batches = eval_batches(self.data.eval, self.cfg.train.batch_size, need_inputs=self.pipe.is_first,
                               need_labels=self.pipe.is_last, pad_to=self.pipe.num_microbatches)
        for index, (inputs, labels, num_sequences) in enumerate(batches, 1):
            total += self.pipe.evaluate(inputs, labels) * num_sequences  # packed: every label counts
            count += num_sequences
            if index == self.cfg.eval.max_batches:
                break
        return total / count

    @property
    def last_checkpoint(self) -> Path | None:
        """The checkpoint this run resumed from or saved last, where it is now (see `published`)."""
        return published(self.checkpoint) if self.checkpoint else None

    def _diverged(self, what: str) -> TrainingDiverged:
        """`what` went wrong, and how to go on: from the last checkpoint, with settings that train more gently."""
        then = f"resume from the last checkpoint, {self.last_checkpoint}," if self.checkpoint else "start again"
        remedies = ["a lower optim.lr", "more optim.warmup_steps",
                    "a lower optim.grad_clip" if self.cfg.optim.grad_clip else "optim.grad_clip = 1.0"]
        if self.cfg.train.dtype != "fp32":
            remedies.append("train.dtype = fp32")
        return TrainingDiverged(f"{what}: {then} with {', '.join(remedies[:-1])} or {remedies[-1]}")

    def _weights_finite(self) -> bool:
        """Whether every rank's weights are finite (one all-reduce, so every rank calls it)."""
        bad = any(not torch.isfinite(p).all() for p in self.pipe.parameters())
        return self.pipe.comm.all_reduce(torch.tensor([float(bad)], device=self.pipe.device)).item() == 0

    def save(self) -> None:
        """Checkpoint this step; refuse weights an update made infinite or NaN, which no resume could use, and
        stop instead if the metrics since the last save still cannot be written: resuming logs them again."""
        try:
            self._agreed(self._metrics_written, "writing the metrics", faults=(OSError,))
        except ConfigError as e:
            raise self._not_saved(e) from None
        if not self._weights_finite():
            raise self._diverged(f"step {self.step}: its update made weights that are not finite (its loss and "
                                 "gradients were); nothing was saved")
        extra = {"step": self.step, "tokens": self.tokens, "data": self.batches.state_dict(),
                 "model_config": self.model_config, **tokenizer_record(self.data.tokenizer),
                 "data_digest": self.data.digest, "data_version": self.data.version,
                 "hf_model": str(Path(self.cfg.hf_model).resolve()) if self.cfg.hf_model else ""}
        try:
            with _stopped_if_asked():
                self.checkpoint = save_checkpoint(self.run_dir, self.step, self.pipe.model, self.optimizer, extra,
                                                  self.cfg.checkpoint.keep_last)
        except OSError as e:  # on every rank alike: a full disk, a directory that became read-only
            raise self._not_saved(e) from e

    def _not_saved(self, why: Exception) -> CheckpointNotSaved:
        """This step's checkpoint could not be written (`why`): how much room is left, and where to go on from."""
        then = f"resume from {self.last_checkpoint}" if self.checkpoint else "start again"
        return CheckpointNotSaved(f"step {self.step}: {why}{room_note(self.run_dir)}; make room or fix the directory, "
                                  f"then {then}")

    def _metrics_written(self) -> None:
        if self.metrics is None:
            return
        self.metrics.write_pending()  # once more: the disk may have room again
        unwritten = self.metrics.unwritten()
        if unwritten:
            path, e = unwritten
            raise OSError(f"could not write {path} ({e.strerror or e}); no checkpoint was saved")

    def fit(self) -> list[dict]:
        """Train to max_steps, evaluating and checkpointing on schedule; returns the logged records."""
        cfg, records = self.cfg, []
        max_steps, p, m = cfg.train.max_steps, self.pipe.pp_size, self.pipe.num_microbatches
        bubble = bubble_fraction(p, m)
        bar = tqdm(total=max_steps, initial=self.step, desc="train", dynamic_ncols=True,
                   disable=not (self.reporter and cfg.log.progress))
        timed_tokens, timed_seconds = 0, 0.0
        while self.step < max_steps:
            start = time.perf_counter()
            record = self.train_step()
            timed_seconds += time.perf_counter() - start
            timed_tokens += _accum_tokens(cfg)
            last = self.step == max_steps
            if self.step % cfg.log.interval == 0 or last:
                rate, idle = timed_tokens / timed_seconds, self.measured_idle_fraction()
                effective = rate / (1 - bubble)
                record |= {"tokens_per_s": rate, "bubble_fraction": bubble, "effective_tokens_per_s": effective,
                           "measured_idle_fraction": idle}
                self._log(record, records)
                bar.set_postfix_str(f"loss {record['loss']:.3f} lr {record['lr']:.2e} {rate:,.0f} tok/s "
                                    f"bubble {bubble:.0%} (idle {idle:.0%}) eff {effective:,.0f} tok/s", refresh=False)
                timed_tokens, timed_seconds = 0, 0.0
            bar.update(1)
            if cfg.eval.interval and (self.step % cfg.eval.interval == 0 or last):
                eval_loss = self.evaluate()
                self._log({"step": self.step, "eval_loss": eval_loss}, records)
                if self.reporter:
                    bar.write(f"step {self.step}: eval loss {eval_loss:.4f}")
            if (cfg.checkpoint.interval and self.step % cfg.checkpoint.interval == 0) or last:
                self.save()
        bar.close()
        self.trained = True
        self.finish()
        return records

    def _log(self, record: dict, records: list) -> None:
        records.append(record)
        if self.metrics is not None:
            self.metrics.log(record)

    def finish(self) -> None:
        """Loss plot, Hugging Face export and a sample on the reporting rank; then leave the group."""
        # The reporter loads the whole model from the checkpoint alone, in a group of its own, which only it makes:
        # made by every rank, a group of one would have the others split NCCL's communicator without it, and hang.
        solo = None
        if self.reporter and dist.is_initialized():
            solo = dist.new_group([dist.get_rank()], backend="gloo", use_local_synchronization=True)
        try:
            if self.reporter:
                self.metrics.close()
                report_run_end(self.cfg, self.metrics.path, self.checkpoint, solo)
        finally:
            self._patient.all_gather_object(None)  # a barrier: the others wait for the export, so the group outlives it
        unlock_dir(self.run_dir)
        if self.owns_group:
            dist.destroy_process_group()


def _accum_tokens(cfg: Config) -> int:
    """Tokens trained on in one optimizer step."""
    return cfg.train.grad_accum_steps * cfg.train.batch_size * cfg.data.seq_len
