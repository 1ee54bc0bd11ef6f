"""Regenerate the assistant answers of a corpus with the target itself (what EAGLE-3, SpecForge and
SpecBlock train on): the drafter then learns the target's own distribution, not the corpus author's.

Resumable: finished conversations are appended to a jsonl file batch by batch (flushed and fsynced). A
killed run leaves at most one partial last line, which the next run drops before it continues with the
conversations not yet in the file, so no row is duplicated or lost. Sampling is seeded per batch (by the
index of its first conversation), so a run resumed after a kill between batches produces exactly what
an uninterrupted one would have; greedy regeneration does in any case.
"""

from __future__ import annotations

import inspect
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor
from tqdm.auto import tqdm
from transformers import DynamicCache

from .target import eos_ids

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

    def __post_init__(self):
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


def read_done(path: Path) -> dict[str, list[Turn]]:
    """Finished conversations in `path`; a partial last line (a killed write) is cut off the file."""
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
    if good_bytes != path.stat().st_size:
        with open(path, "r+b") as f:
            f.truncate(good_bytes)
    return done


@torch.inference_mode()
def generate_batch(
    model, tokenizer, prompts: list[list[Turn]], cfg: RegenerateConfig, seed: int
) -> list[str]:
    """One batch of chat-template prompts (left padding) -> greedy or sampled answers (EOS excluded)."""
    texts = [tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False) for p in prompts]
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
    model, tokenizer, conversations: list[Conversation], out_path: str | Path, cfg: RegenerateConfig
) -> list[Conversation]:
    """Answers of `conversations` rewritten by `model`; returns them in input order.

    out_path: the resumable jsonl ({"id", "turns"} per line). Conversations are processed in batches of
    cfg.batch_size; each batch runs its user rounds one after another (round r sees the answers of
    rounds < r) and is appended to out_path once finished.
    """
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    done = read_done(out_path)
    todo = [(i, c) for i, c in enumerate(conversations) if c[0] not in done]
    bar = tqdm(
        total=len(conversations), initial=len(conversations) - len(todo), desc="regenerate", unit="conv"
    )
    with open(out_path, "a", encoding="utf-8") as sink:
        for start in range(0, len(todo), cfg.batch_size):
            batch = todo[start : start + cfg.batch_size]
            finished = regenerate_batch(
                model, tokenizer, [c for _, c in batch], cfg, seed=cfg.seed + batch[0][0]
            )
            lines = [
                json.dumps({"id": cid, "turns": turns}, ensure_ascii=False) + "\n" for cid, turns in finished
            ]
            sink.write("".join(lines))  # one write per batch: a kill rarely splits a batch
            done.update(finished)
            sink.flush()
            os.fsync(sink.fileno())
            bar.update(len(batch))
    bar.close()
    return [(cid, done[cid]) for cid, _ in conversations]


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
