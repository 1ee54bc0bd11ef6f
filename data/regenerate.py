"""Regenerate the assistant answers of a corpus with the target itself (what EAGLE-3, SpecForge and
SpecBlock train on): the drafter then learns the target's own distribution, not the corpus author's.

Resumable: finished conversations are appended to a jsonl file batch by batch (flushed and fsynced). A
killed run leaves at most one partial last line, which the next run drops before it continues with the
conversations not yet in the file, so no row is duplicated or lost. Sampling is seeded per batch (by the
index of its first conversation), so a run resumed after a kill between batches produces exactly what
an uninterrupted one would have; greedy regeneration does in any case.

Several ranks (`accelerate launch`, see data/world.py): batch b of the conversations (the batches a single
process would form) belongs to rank b % size, which appends it to its own part file
`<out>.rank<r>.jsonl` and resumes from it; once every rank is done, rank 0 appends the parts' rows to
`<out>` in input order (through a temporary copy renamed into place) and deletes the parts. Batches,
seeds and line bytes are those of a single process, so the merged file is the one it writes.

Backends (`cfg.backend`, registry BACKENDS): `hf`, this module's own batched decoding with a KV cache, and
`vllm`, offline generation through vLLM (data/vllm_backend.py).
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor
from tqdm.auto import tqdm
from transformers import DynamicCache

from . import vllm_backend
from .hardware import WEIGHT_LAYOUTS, resolve_layout, set_weight_layout
from .io import atomic_path
from .target import TargetConfig, eos_ids
from .world import World

log = logging.getLogger(__name__)

Turn = dict[str, str]
Conversation = tuple[str, list[Turn]]  # (row id, turns)


@dataclass
class RegenerateConfig:
    enabled: bool = True
    turns: int = 1  # leading user turns kept; each gets a regenerated answer (later turns are dropped)
    max_new_tokens: int = 256
    max_prompt_tokens: int = 512  # longer first prompts are dropped; later rounds are left-truncated
    batch_size: int = 8
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int = 0
    # hf | vllm (registry BACKENDS). Not part of the data's recipe: backends differ only in rounding.
    backend: str = "hf"
    # the hf backend's linear layers: row, column, packed or auto (data/hardware.py, as the evaluation's
    # weight_layout; a batch's decoding step multiplies batch_size rows, where MKL's packed product is
    # 15-30 % faster on the session-15 Xeon). Not part of the recipe either: only the rounding changes.
    weight_layout: str = "auto"
    # regenerated.jsonl files (or data folders holding one) of earlier runs: a conversation whose prompt (its
    # system turn and kept user turns) is a row's there takes that row's answers instead of being regenerated
    # (`reuse_answers`). Not part of the recipe: the rows must come from the same target and settings, which
    # prepare checks where the folder's token manifest records them.
    reuse: list[str] = field(default_factory=list)

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"regenerate.backend={self.backend!r} is not one of {sorted(BACKENDS)}")
        if self.weight_layout not in ("auto", *WEIGHT_LAYOUTS):
            raise ValueError(
                f"regenerate.weight_layout={self.weight_layout!r} is not one of auto, {', '.join(WEIGHT_LAYOUTS)}"
            )
        if self.turns < 1 or self.max_new_tokens < 1 or self.batch_size < 1:
            raise ValueError(f"regenerate needs turns, max_new_tokens and batch_size >= 1, got {self}")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"regenerate needs temperature >= 0 and 0 < top_p <= 1, got {self}")


def user_rounds(turns: list[Turn], keep: int) -> tuple[list[Turn], list[Turn]]:
    """Split into the leading system turns and the first `keep` user turns (assistant turns dropped)."""
    system = [t for t in turns[:1] if t["role"] == "system"]
    users = [t for t in turns if t["role"] == "user"][:keep]
    return system, users


def fitting_prompts(
    tokenizer, conversations: list[Conversation], cfg: RegenerateConfig, policy
) -> list[Conversation]:
    """Conversations whose first prompt (system + first user turn, templated) has at most
    cfg.max_prompt_tokens tokens; the others are counted in `policy` (a RowPolicy) and dropped: cutting a
    chat prompt would cut its template header or its question."""
    kept = []
    for cid, turns in conversations:
        system, users = user_rounds(turns, 1)
        if not users:
            policy.skipped["no user turn"] += 1
            continue
        text = tokenizer.apply_chat_template(system + users, add_generation_prompt=True, tokenize=False)
        if len(tokenizer(text, add_special_tokens=False)["input_ids"]) > cfg.max_prompt_tokens:
            policy.skipped[f"prompt longer than max_prompt_tokens={cfg.max_prompt_tokens}"] += 1
            continue
        kept.append((cid, turns))
    return kept


def read_done(path: Path, repair: bool = True) -> dict[str, list[Turn]]:
    """Finished conversations in `path`; a partial last line (a killed write) is ignored, and cut off the
    file when `repair` (only by the file's own writer: another rank may be appending to it)."""
    if not path.exists():
        return {}
    done, good_bytes = {}, 0
    with open(path, "rb") as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                break  # only the last line can be partial: everything before it was fsynced
            if not line.endswith(b"\n"):
                break
            done[row["id"]] = row["turns"]
            good_bytes += len(line)
    if repair and good_bytes != path.stat().st_size:
        with open(path, "r+b") as f:
            f.truncate(good_bytes)
    return done


def generate_batch(
    model, tokenizer, prompts: list[list[Turn]], cfg: RegenerateConfig, seed: int
) -> list[str]:
    """One batch of chat prompts -> greedy or sampled answers (EOS excluded), by cfg.backend's `model`."""
    texts = [tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False) for p in prompts]
    return BACKENDS[cfg.backend].generate(model, tokenizer, texts, cfg, seed)


def hf_load(target: TargetConfig, cfg: RegenerateConfig, world: World, hf_model: Callable[[], Any]):
    """The hf backend's model: the HF target (loaded once, shared with feature capture) with its linear
    layers in cfg.weight_layout (capture's long rows take the plain product: data/packed.MAX_ROWS)."""
    model = hf_model()
    set_weight_layout(model, resolve_layout(cfg.weight_layout, str(model.device)))
    return model


@torch.inference_mode()
def hf_generate(model, tokenizer, texts: list[str], cfg: RegenerateConfig, seed: int) -> list[str]:
    """The hf backend: chat-templated prompt texts (left padding, cut from the left to
    cfg.max_prompt_tokens) -> answers, decoded with a shrinking batch (decode_shrinking)."""
    tokenizer.padding_side, tokenizer.truncation_side = "left", "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    enc = tokenizer(
        texts,
        return_tensors="pt",
        padding=True,
        truncation=True,
        max_length=cfg.max_prompt_tokens,
        add_special_tokens=False,
    ).to(model.device)
    rows = decode_shrinking(
        model, enc["input_ids"], enc["attention_mask"], cfg, torch.tensor(eos_ids(tokenizer, model)), seed
    )
    return [tokenizer.decode(row, skip_special_tokens=True).strip() for row in rows]


def next_tokens(logits: Tensor, cfg: RegenerateConfig, generator: torch.Generator) -> Tensor:
    """[B, V] logits -> [B] tokens: argmax at temperature 0, else a sample of the tempered, top-p law."""
    if cfg.temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / cfg.temperature, dim=-1)
    if cfg.top_p < 1:
        sorted_p, order = probs.sort(-1, descending=True)
        outside = sorted_p.cumsum(-1) - sorted_p >= cfg.top_p  # mass before the token already reaches top_p
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p.masked_fill(outside, 0.0))
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def decode_shrinking(
    model, input_ids: Tensor, attention_mask: Tensor, cfg: RegenerateConfig, stop: Tensor, seed: int
) -> list[list[int]]:
    """Batched decoding with a KV cache from left-padded input_ids / attention_mask [B, T]; a row leaves
    the batch (and the cache) when it emits a stop id, so finished answers cost nothing while the longest
    one runs on (`generate` keeps computing finished rows to the end). Returns each row's new tokens,
    the stop id included."""
    generator = torch.Generator(device=input_ids.device).manual_seed(seed)
    cache = DynamicCache(config=model.config)
    # transformers 5 renames the forward's `past_key_values` to `cache` (the old name is deprecated)
    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    mask = attention_mask
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(
        input_ids=input_ids,
        attention_mask=mask,
        position_ids=positions,
        logits_to_keep=1,
        **{kw: cache},
    ).logits[:, -1]
    alive, answers = torch.arange(len(input_ids)), [[] for _ in range(len(input_ids))]
    for step in range(cfg.max_new_tokens):
        token = next_tokens(logits, cfg, generator)
        for row, t in zip(alive.tolist(), token.tolist()):
            answers[row].append(t)
        keep = ~torch.isin(token, stop.to(token.device))
        if step == cfg.max_new_tokens - 1 or not keep.any():
            break
        if not keep.all():
            index = keep.nonzero()[:, 0]
            cache.batch_select_indices(index)
            alive, token, mask = alive[index.cpu()], token[index], mask[index]
        mask = torch.cat([mask, mask.new_ones(len(mask), 1)], dim=1)
        positions = mask.sum(-1, keepdim=True) - 1
        logits = model(
            input_ids=token[:, None], attention_mask=mask, position_ids=positions, **{kw: cache}
        ).logits[:, -1]
    return answers


def regenerate(
    model,
    tokenizer,
    conversations: list[Conversation],
    out_path: str | Path,
    cfg: RegenerateConfig,
    world: World = World(),
) -> list[Conversation]:
    """Answers of `conversations` rewritten by `model`; returns them in input order.

    out_path: the resumable jsonl ({"id", "turns"} per line). Conversations are processed in batches of
    cfg.batch_size; each batch runs its user rounds one after another (round r sees the answers of
    rounds < r) and is appended to out_path once finished. With several ranks (`world`), each rank
    regenerates its own batches into its part file and rank 0 merges the parts into out_path (module
    docstring); rank 0 returns the conversations, the other ranks [] (the next steps run on rank 0).
    """
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    if cfg.reuse and world.is_main:  # before any rank starts: every rank then finds these rows done
        reuse_answers(conversations, out_path, cfg)
    world.barrier()
    sink = out_path if world.size == 1 else part_path(out_path, world.rank)
    done = read_done(sink)
    for other in [out_path, *part_paths(out_path)]:  # rows finished by earlier runs, whatever their ranks
        if other != sink:
            done.update(read_done(other, repair=False))
    mine = [(i, c) for i, c in enumerate(conversations) if world.owns(i // cfg.batch_size)]
    todo = [(i, c) for i, c in mine if c[0] not in done]
    if world.size > 1:
        log.info(
            f"regenerate, rank {world.rank} of {world.size}: {len(mine) - len(todo)} of {len(mine)} "
            f"conversations already done, writing {sink}"
        )
    append_batches(model, tokenizer, todo, sink, cfg, initial=len(mine) - len(todo))
    world.barrier()  # every part is complete
    if not world.is_main:
        return []
    done = merge_parts(out_path, conversations)
    return [(cid, done[cid]) for cid, _ in conversations]


def prompt_key(turns: list[Turn], keep: int) -> str:
    """What a regenerated answer depends on besides the settings: the system turn and the first `keep` user
    turns (`user_rounds`), as one string."""
    system, users = user_rounds(turns, keep)
    return json.dumps(system + users, ensure_ascii=False)


def reuse_file(path: str | Path) -> Path:
    """A `regenerate.reuse` entry as a file: a data folder means its regenerated.jsonl."""
    path = Path(path).expanduser()
    found = path / "regenerated.jsonl" if path.is_dir() else path
    if not found.is_file():
        raise FileNotFoundError(f"regenerate.reuse: no regenerated answers at {found}")
    return found


def reuse_answers(conversations: list[Conversation], out_path: Path, cfg: RegenerateConfig) -> int:
    """Appends to out_path (one fsynced write, in input order) every conversation not yet in it whose prompt
    (`prompt_key`) is a row's of a `cfg.reuse` file, with that row's turns; returns how many. The first file
    that holds a prompt gives its answers."""
    answers: dict[str, list[Turn]] = {}
    for entry in cfg.reuse:
        for turns in read_done(reuse_file(entry), repair=False).values():
            answers.setdefault(prompt_key(turns, cfg.turns), turns)
    done = read_done(out_path)
    taken = {}
    for cid, turns in conversations:
        key = prompt_key(turns, cfg.turns)
        if cid not in done and cid not in taken and key in answers:
            taken[cid] = answers[key]
    if taken:
        with open(out_path, "a", encoding="utf-8") as f:
            f.write("".join(jsonl_line(cid, turns) for cid, turns in taken.items()))
            f.flush()
            os.fsync(f.fileno())
    log.info(f"regenerate: {len(taken)} answers reused from {', '.join(map(str, cfg.reuse))}")
    return len(taken)


def append_batches(
    model, tokenizer, todo: list[tuple[int, Conversation]], sink: Path, cfg: RegenerateConfig, initial: int
) -> None:
    """Regenerates `todo` ((input index, conversation) pairs) batch by batch, appending each finished
    batch to `sink` in one fsynced write; a batch is seeded by the input index of its first row."""
    bar = tqdm(total=initial + len(todo), initial=initial, desc="regenerate", unit="conv")
    with open(sink, "a", encoding="utf-8") as f:
        for start in range(0, len(todo), cfg.batch_size):
            batch = todo[start : start + cfg.batch_size]
            finished = regenerate_batch(
                model, tokenizer, [c for _, c in batch], cfg, seed=cfg.seed + batch[0][0]
            )
            f.write("".join(jsonl_line(cid, turns) for cid, turns in finished))  # a kill rarely splits it
            f.flush()
            os.fsync(f.fileno())
            bar.update(len(batch))
    bar.close()


def jsonl_line(cid: str, turns: list[Turn]) -> str:
    return json.dumps({"id": cid, "turns": turns}, ensure_ascii=False) + "\n"


def part_path(out_path: Path, rank: int) -> Path:
    """Rank `rank`'s part of out_path: regenerated.jsonl -> regenerated.rank<rank>.jsonl."""
    return out_path.with_name(f"{out_path.stem}.rank{rank}{out_path.suffix}")


def part_paths(out_path: Path) -> list[Path]:
    """The part files beside out_path, from any earlier world size, by rank."""
    pattern = re.compile(re.escape(out_path.stem) + r"\.rank(\d+)" + re.escape(out_path.suffix))
    found = [(int(m.group(1)), p) for p in out_path.parent.iterdir() if (m := pattern.fullmatch(p.name))]
    return [p for _, p in sorted(found)]


def merge_parts(out_path: Path, conversations: list[Conversation]) -> dict[str, list[Turn]]:
    """Rank 0, once no rank writes any more: out_path's finished rows plus those of the part files, which
    are appended to out_path (input order first, then rows of conversations this run did not ask for, so
    none is lost) through a copy renamed into place; the parts are then deleted. Returns every row."""
    done, parts = read_done(out_path), part_paths(out_path)
    if not parts:
        return done
    found: dict[str, list[Turn]] = {}
    for part in parts:
        found.update(read_done(part, repair=False))
    order = [cid for cid, _ in conversations if cid in found] + list(found)
    new = {cid: found[cid] for cid in order if cid not in done}
    with atomic_path(out_path) as tmp:
        if out_path.exists():
            shutil.copyfile(out_path, tmp)
        with open(tmp, "a", encoding="utf-8") as f:
            f.write("".join(jsonl_line(cid, turns) for cid, turns in new.items()))
            f.flush()
            os.fsync(f.fileno())
    for part in parts:  # after the rename: a kill in between leaves rows that the next merge skips
        part.unlink()
    return {**done, **new}


def regenerate_batch(
    model, tokenizer, batch: list[Conversation], cfg: RegenerateConfig, seed: int
) -> list[Conversation]:
    """Regenerate every kept user round of a batch of conversations, round by round."""
    split = [user_rounds(turns, cfg.turns) for _, turns in batch]
    convs: list[list[Turn]] = [list(system) for system, _ in split]
    for r in range(max(len(users) for _, users in split)):
        active = [i for i, (_, users) in enumerate(split) if r < len(users)]
        for i in active:
            convs[i].append(split[i][1][r])
        answers = generate_batch(model, tokenizer, [convs[i] for i in active], cfg, seed=seed * 1000 + r)
        for i, answer in zip(active, answers):
            convs[i].append({"role": "assistant", "content": answer})
    return [(cid, turns) for (cid, _), turns in zip(batch, convs)]


@dataclass(frozen=True)
class Backend:
    """How answers are generated. check(): raises a clear error if the backend cannot run here (before
    any work); load(target, cfg, world, hf_model): the generating model (hf_model() loads the HF target
    once, shared with feature capture); generate(model, tokenizer, texts, cfg, seed): one batch of
    chat-templated prompt texts -> answers."""

    check: Callable[[], None]
    load: Callable[[TargetConfig, RegenerateConfig, World, Callable[[], Any]], Any]
    generate: Callable[[Any, Any, list[str], RegenerateConfig, int], list[str]]


BACKENDS: dict[str, Backend] = {
    "hf": Backend(check=lambda: None, load=hf_load, generate=hf_generate),
    "vllm": Backend(
        check=vllm_backend.import_vllm,
        load=lambda target, cfg, world, hf_model: vllm_backend.load(target, cfg, world),
        generate=vllm_backend.generate,
    ),
}
