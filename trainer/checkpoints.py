"""Checkpoints: what a rerun of a training run needs to carry on exactly where it stopped.

    RUN_DIR/checkpoints/step-000012/
        MODEL_NAME/        the policy as a Hugging Face folder (safetensors, config, tokenizer):
                           `polar serve inference --model` and transformers load it as it is
        optimizer.pt       the optimizer state
        state.json         TrainerState: step, results cursor, policy version, submitted tasks, ...
    RUN_DIR/checkpoints/latest   the name of the newest complete checkpoint

A checkpoint is written into a scratch folder and renamed into place, and `latest` is replaced
atomically after it, so a run stopped at any moment leaves the previous checkpoint intact. Only the
newest `keep` checkpoints stay.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    # Only for annotations: `polar train`'s supervisor reads checkpoints without loading torch.
    from trainer.backends.base import Backend

LATEST = "latest"
STATE_FILE = "state.json"
OPTIMIZER_FILE = "optimizer.pt"


class CheckpointError(ValueError):
    """A checkpoint that cannot be read, or that belongs to another model or vocabulary."""


@dataclass
class TrainerState:
    """The loop's position in a run; what a checkpoint restores besides the weights."""

    step: int = 0  # optimizer steps completed
    cursor: str = ""  # results cursor of the last group the completed steps consumed
    policy_version: int = 0  # version the inference servers serve these weights as
    groups_consumed: int = 0  # groups taken from the results stream (trained on or dropped)
    tasks_submitted: int = 0  # dataset tasks submitted to the rollout server (the next one's index)
    trajectories_consumed: int = 0
    trained_tokens: int = 0
    elapsed_s: float = 0.0  # training wall-clock before this process started, for elapsed_s metrics
    base_model: str = ""  # the [trainer] model the run started from
    # The run's [trainer] task_prefix and lora_adapter_name: a run on a stack others share (`polar
    # train --join`) named them itself, and takes them back when it resumes
    task_prefix: str = ""
    lora_adapter_name: str = ""
    model: dict[str, object] = field(default_factory=dict)  # Backend.model_description

    @classmethod
    def from_json(cls, text: str, where: Path) -> TrainerState:
        try:
            data = json.loads(text)
            known = {f.name for f in fields(cls)}
            return cls(**{key: value for key, value in data.items() if key in known})
        except (ValueError, TypeError) as exc:
            raise CheckpointError(f"checkpoint state {where} is unreadable: {exc}") from None


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint on disk."""

    path: Path
    state: TrainerState

    @property
    def model_folder(self) -> Path:
        folders = [p for p in self.path.iterdir() if p.is_dir()]
        if len(folders) != 1:
            raise CheckpointError(f"checkpoint {self.path} should hold one model folder, found {len(folders)}")
        return folders[0]

    @property
    def optimizer_file(self) -> Path:
        return self.path / OPTIMIZER_FILE


def checkpoints_folder(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def save_checkpoint(root: Path, backend: Backend, state: TrainerState, model_name: str, keep: int = 2) -> Checkpoint:
    """Write a checkpoint of the backend and state as root/step-N (root: a run's checkpoints_folder,
    or any folder SaveCheckpoint names) and mark it latest there."""
    root.mkdir(parents=True, exist_ok=True)
    name = f"step-{state.step:06d}"
    target = root / name
    scratch = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    try:
        backend.save(scratch / model_name, scratch / OPTIMIZER_FILE)
        (scratch / STATE_FILE).write_text(json.dumps(asdict(state), indent=2) + "\n")
        if target.exists():
            shutil.rmtree(target)  # the same step written again (e.g. SaveCheckpoint, then the stop)
        scratch.rename(target)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    _write_atomically(root / LATEST, name + "\n")
    _prune(root, keep, name)
    return Checkpoint(target, state)


def latest_checkpoint(run_dir: Path) -> Checkpoint | None:
    """The newest complete checkpoint of the run, or None when it has none."""
    root = checkpoints_folder(run_dir)
    try:
        name = (root / LATEST).read_text().strip()
    except FileNotFoundError:
        return None
    path = root / name
    try:
        text = (path / STATE_FILE).read_text()
    except OSError as exc:
        raise CheckpointError(f"the latest checkpoint {path} is unreadable: {exc.strerror}") from None
    return Checkpoint(path, TrainerState.from_json(text, path / STATE_FILE))


def check_compatible(checkpoint: Checkpoint, base_model: str, model: dict[str, object]) -> None:
    """CheckpointError unless the checkpoint continues this run's model (same base, same shapes and
    vocabulary): resuming another model's weights into this one would fail late or silently."""
    saved = checkpoint.state
    if saved.base_model and saved.base_model != base_model:
        raise CheckpointError(
            f"checkpoint {checkpoint.path} continues model {saved.base_model!r}, but [trainer] model is "
            f"{base_model!r}; use another --run-dir or the same model"
        )
    for key, value in model.items():
        if key in saved.model and saved.model[key] != value:
            raise CheckpointError(
                f"checkpoint {checkpoint.path} has {key} {saved.model[key]!r}, the model has {value!r}: "
                "it belongs to another model or vocabulary"
            )


def _write_atomically(path: Path, text: str) -> None:
    scratch = path.with_name(f".{path.name}.{os.getpid()}")
    scratch.write_text(text)
    os.replace(scratch, path)


def _prune(root: Path, keep: int, newest: str) -> None:
    steps = sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-"))
    for path in steps[: max(0, len(steps) - max(keep, 1))]:
        if path.name != newest:
            shutil.rmtree(path, ignore_errors=True)
