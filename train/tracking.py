"""Rank-aware side effects in one place: `is_main`, `log0`, and the experiment trackers.

Only rank 0 prints or logs. `make_tracker("none")` never imports wandb; `make_tracker("wandb")`
goes through accelerate's tracker (`Accelerator(log_with="wandb")`), which logs on the main process
only. Anchors: nanochat `print0`/`DummyWandb`, lightning-hydra-template `RankedLogger`.
"""

from __future__ import annotations

import logging
import netrc
import os
import re
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

TRACKERS = ("wandb", "none")
WANDB_HOST = "https://api.wandb.ai"  # WANDB_BASE_URL overrides it, as in wandb
REDACTED = "<redacted>"
# Config keys whose values must never reach a log or a tracker (habit: no secrets in configs).
SECRET_KEY = re.compile(
    r"(api[_-]?key|secret|password|passwd|(access|auth|hf|hub|wandb)[_-]?token|^token$)", re.IGNORECASE
)

logger = logging.getLogger("specblock.train")


def is_main() -> bool:
    """True on the global rank 0, and in a plain single process.

    Reads RANK, which `accelerate launch`, torchrun and the DeepSpeed launcher set on every rank,
    so it is safe to call before any process group exists and has no side effects.
    """
    return int(os.environ.get("RANK", "0")) == 0


def log0(msg: str) -> None:
    """Log `msg` at INFO level, on rank 0 only."""
    if is_main():
        logger.info(msg)


def warn0(msg: str) -> None:
    """Log `msg` at WARNING level, on rank 0 only."""
    if is_main():
        logger.warning(msg)


HEADLINE = ("top1", "accept_len", "rank_acc")  # metric names the console lines show


def headline(metrics: Mapping[str, float], prefix: str) -> str:
    """The first block's headline metrics among those named `prefix`... ("train/" or "val/"), as
    "accept_len 0.1634, rank_acc_0 0.5998, top1_0 0.1380, ..." (every metric goes to the tracker)."""
    n = len(prefix)
    shown = {
        k[n:]: v
        for k, v in metrics.items()
        if k.startswith(prefix) and "/" not in k[n:] and any(h in k[n:] for h in HEADLINE)
    }
    return ", ".join(f"{k} {v:.4f}" for k, v in sorted(shown.items()))


def redact_secrets(config: Any) -> Any:
    """A copy of a nested config (dicts/lists) with the values of secret-looking keys replaced."""
    if isinstance(config, Mapping):
        return {k: REDACTED if SECRET_KEY.search(str(k)) else redact_secrets(v) for k, v in config.items()}
    if isinstance(config, (list, tuple)):
        return [redact_secrets(v) for v in config]
    return config


def wandb_credentials(env: Mapping[str, str] | None = None) -> str | None:
    """Where wandb would find an API key without prompting, or None: WANDB_API_KEY, else the netrc file
    (NETRC, else ~/.netrc) entry for the W&B host (WANDB_BASE_URL's, else api.wandb.ai) that `wandb login`
    writes. A key kept only in wandb's settings file is not seen: WANDB_MODE=online insists."""
    env = os.environ if env is None else env
    if env.get("WANDB_API_KEY"):
        return "WANDB_API_KEY"
    path = Path(env.get("NETRC") or Path.home() / ".netrc").expanduser()
    host = urlsplit(env.get("WANDB_BASE_URL") or WANDB_HOST).netloc
    try:
        found = bool(host) and netrc.netrc(str(path)).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):  # no file, unreadable, malformed: no key from it
        found = False
    return str(path) if found else None


def settle_wandb_mode(kind: str, log_dir: Path, env: MutableMapping[str, str] | None = None) -> str | None:
    """W&B's mode, decided before any long work (the data stage, a feature capture): without it wandb looks
    for a key only when the trackers start, after the data stage, and a run without a login died there.
    For `logger=wandb` with WANDB_MODE unset and no key (`wandb_credentials`) it sets WANDB_MODE=offline in
    `env` (os.environ by default) and returns the line to log; otherwise it changes nothing (None)."""
    env = os.environ if env is None else env
    if kind != "wandb" or env.get("WANDB_MODE") or wandb_credentials(env):
        return None
    env["WANDB_MODE"] = "offline"
    return (
        "logger=wandb, and no W&B API key was found (WANDB_API_KEY, or `wandb login`'s netrc entry): W&B logs "
        f"offline to {log_dir / 'wandb'} (upload with `wandb sync {log_dir / 'wandb'}/offline-run-*`); "
        "WANDB_MODE=online insists on logging online, trainer.logger=none turns W&B off"
    )


class NullTracker:
    """The tracker for `logger=none`: same methods as `WandbTracker`, does nothing."""

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        pass

    def finish(self) -> None:
        pass


class WandbTracker:
    """W&B through accelerate. The Accelerator must have been built with `log_with="wandb"`.

    With WANDB_MODE=offline the run lands in `<log_dir>/wandb/offline-run-*` (no network, no key).
    """

    def __init__(self, accelerator, project: str, run_name: str, config: Mapping[str, Any], log_dir: Path):
        log_dir.mkdir(parents=True, exist_ok=True)
        self.accelerator = accelerator
        accelerator.init_trackers(
            project,
            config=redact_secrets(dict(config)),
            init_kwargs={"wandb": {"dir": str(log_dir), "name": run_name}},
        )

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self.accelerator.log(dict(metrics), step=step)

    def finish(self) -> None:
        self.accelerator.end_training()


def accelerate_log_with(kind: str) -> str | None:
    """The `log_with` argument the Accelerator needs for tracker `kind`."""
    if kind not in TRACKERS:
        raise ValueError(f"logger={kind!r}; expected one of {TRACKERS}")
    return None if kind == "none" else kind


def make_tracker(
    kind: str,
    accelerator=None,
    *,
    project: str = "",
    run_name: str = "",
    config: Mapping[str, Any] | None = None,
    log_dir: Path | None = None,
) -> NullTracker | WandbTracker:
    """`NullTracker()` for "none" (wandb is not imported); otherwise a `WandbTracker`."""
    if accelerate_log_with(kind) is None:
        return NullTracker()
    if accelerator is None or log_dir is None:
        raise ValueError(f"logger={kind!r} needs the accelerator and a log_dir")
    return WandbTracker(accelerator, project, run_name, config or {}, log_dir)
