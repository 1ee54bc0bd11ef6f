"""The SpecBlock drafter (docs/specblock.md 1.2, 1.4, 1.5): one forward drafts a block of K dependent slots.

Alignment. Context position t reads condition = features[:, t] (the target's low|mid|high hidden states
at t) and token = input_ids[:, t] (already aligned by the trainer: the target's token t+1, at inference
the just-verified token). Slot k predicts token t+2+k and gets RoPE id t+1+k (+ offsets).

Block 1. x[t,k] = W_fuse [RMSNorm(condition_proj(features_t)); RMSNorm(embed(token_t)); RMSNorm(q_k)];
attention "cross-position causal all-slot": query (t, s) sees every slot of the earlier non-padding
positions and slots 0..s of its own position; before every layer l > 0 the layer-wise shift
h_k <- W_l [h_k ; h_{k-1}] (slot 0 pairs with itself); logits = lm_head(norm(h)).

Later blocks (cross-block inheritance). Block b+1 starts at every position t from a slot m of block b:
condition = block b's pre-norm hidden[:, t, m] (no condition_proj), tokens shifted left by the
cumulative offset o_{b+1} = o_b + m + 1 (its slot k predicts token t+2+o_{b+1}+k, RoPE id
t+1+o_{b+1}+k). It attends to block 1's slots of earlier positions, to slots <= m_j of every earlier
block j at its own position, and causally to its own slots; block 1's KV is not detached.

Our choices where the reference is silent [L]: condition_proj has no bias; each shift projection starts
as [I | 0] (the plain drafter) and learns how much of slot k-1 to mix in; masked queries at padding
positions still see their own slots (no empty softmax rows; their loss is masked by the trainer).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import PretrainedConfig

from .common import (
    KV,
    DecoderLayer,
    DraftCache,
    DrafterConfig,
    DrafterOutput,
    DraftStep,
    RMSNorm,
    Rotary,
    draft_lm_head,
    drafter_layer_config,
    frozen_embedding,
    grid_mask,
    position_ids,
    row_starts,
    shift_left,
    slot_mask,
)
from .vocab import resolve_vocab_map, t2d_from_d2t

# The reference approximates the draft log-softmax by a log-softmax over its top-20 logits.
RANK_SOFTMAX_TOPK = 20
# Features besides the top-k log-probs: gaps top1-top2, top1-top3, top1-top5, top-1 prob, entropy.
RANK_EXTRA_FEATURES = 5
SLOT_QUERY_STD = 0.02  # the reference's init of the slot query embedding


@dataclass
class SpecBlockConfig(DrafterConfig):
    """block_size K slots per block; num_layers decoder layers; rank_buckets: upper rank bound of each
    rank class but the last (C = len + 1: 1 / 2-4 / 5-10 / >10), the classes the Rank Head predicts and
    its loss trains (the one place they are set); rank_hidden: width of the rank MLP; rank_topk: top-k
    log-probs among its input features. The fields every drafter has: `DrafterConfig`."""

    name: str = "specblock"
    block_size: int = 4
    num_layers: int = 2
    rank_buckets: list[int] = field(default_factory=lambda: [1, 4, 10])
    rank_hidden: int = 256
    rank_topk: int = 10

    def __post_init__(self):
        super().__post_init__()
        self.rank_buckets = list(self.rank_buckets)
        if self.block_size < 1 or self.num_layers < 1:
            raise ValueError(
                f"block_size and num_layers must be >= 1, got {self.block_size}, {self.num_layers}"
            )
        b = self.rank_buckets
        if not b or b[0] < 1 or any(x >= y for x, y in zip(b, b[1:])):
            raise ValueError(f"rank_buckets must be strictly increasing ranks >= 1, got {b}")
        if not 1 <= self.rank_topk <= RANK_SOFTMAX_TOPK:
            raise ValueError(f"rank_topk must be in [1, {RANK_SOFTMAX_TOPK}], got {self.rank_topk}")

    @property
    def num_rank_classes(self) -> int:
        return len(self.rank_buckets) + 1


@torch.no_grad()
def rank_features(logits: Tensor, topk: int) -> Tensor:
    """[..., Vd] draft logits -> [..., topk+5] float32 confidence features (no gradient): top-k
    log-probs and the entropy / top-1 prob of a softmax over the top-20 logits, logit gaps
    top1-top2, top1-top3, top1-top5."""
    top = logits.detach().topk(RANK_SOFTMAX_TOPK, dim=-1).values.float()  # [...,20] descending, exact
    logp = top.log_softmax(-1)
    gaps = top[..., :1] - top[..., [1, 2, 4]]  # [...,3]
    entropy = -(logp.exp() * logp).sum(-1, keepdim=True)
    return torch.cat([logp[..., :topk], gaps, logp[..., :1].exp(), entropy], dim=-1)


class RankHead(nn.Module):
    """MLP(H + topk + 5 -> rank_hidden -> C) on [detach(norm(h)); rank_features(logits)]: predicts the
    rank class of the target token in the draft distribution; the trunk gets no gradient from it."""

    def __init__(self, hidden_size: int, cfg: SpecBlockConfig):
        super().__init__()
        self.topk = cfg.rank_topk
        self.proj = nn.Linear(hidden_size + cfg.rank_topk + RANK_EXTRA_FEATURES, cfg.rank_hidden, bias=False)
        self.out = nn.Linear(cfg.rank_hidden, cfg.num_rank_classes)

    def forward(self, normed: Tensor, logits: Tensor) -> Tensor:
        """normed [...,H], logits [...,Vd] -> rank logits [...,C]."""
        feats = rank_features(logits, self.topk).to(normed.dtype)
        return self.out(F.silu(self.proj(torch.cat([normed.detach(), feats], dim=-1))))


class SlotFusion(nn.Module):
    """x[n,k] = W_fuse [RMSNorm(cond_n); RMSNorm(emb_n); RMSNorm(q_k)], W_fuse [H, 3H] (a Linear(3H -> H)
    without bias), computed as three H x H products broadcast over slots (never materialising the
    [.., K, 3H] concat). W_fuse is this module's own parameter so that ZeRO-3, which gathers a module's
    parameters when it is called, has it in place."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.cond_norm = RMSNorm(hidden_size, eps=eps)
        self.token_norm = RMSNorm(hidden_size, eps=eps)
        self.query_norm = RMSNorm(hidden_size, eps=eps)
        self.weight = nn.Parameter(nn.Linear(3 * hidden_size, hidden_size, bias=False).weight.detach())

    def forward(self, cond: Tensor, emb: Tensor, queries: Tensor) -> Tensor:
        """cond, emb [B,N,H]; queries [K,H] -> x [B,N,K,H]."""
        w_cond, w_emb, w_query = self.weight.chunk(3, dim=1)  # each [H,H]
        shared = F.linear(self.cond_norm(cond), w_cond) + F.linear(self.token_norm(emb), w_emb)  # [B,N,H]
        return shared[:, :, None] + F.linear(self.query_norm(queries), w_query)  # [B,N,K,H]


def layer_shift(h: Tensor, proj: nn.Linear) -> Tensor:
    """h [B,N,K,H] -> proj([h_k ; h_{k-1}]) [B,N,K,H]; slot 0 uses h_0 for both halves."""
    prev = torch.cat([h[:, :, :1], h[:, :, :-1]], dim=2)  # [B,N,K,H] slot k-1's state at slot k
    return proj(torch.cat([h, prev], dim=-1))


def _shift_projection(hidden_size: int) -> nn.Linear:
    """Linear(2H -> H, no bias) initialised to [I | 0]: the identity on h_k, nothing from h_{k-1} yet."""
    proj = nn.Linear(2 * hidden_size, hidden_size, bias=False)
    with torch.no_grad():
        proj.weight.zero_()
        proj.weight[:, :hidden_size].copy_(torch.eye(hidden_size))
    return proj


def block_offsets(source_slots: Sequence[int]) -> list[int]:
    """Token offset of every block of `forward_blocks`: [0, m1+1, m1+m2+2, ...]. Block b's slot k at
    position t predicts token t+2+offset_b+k: the trainer shifts targets and masks by offset_b."""
    offsets = [0]
    for m in source_slots:
        offsets.append(offsets[-1] + m + 1)
    return offsets


class SpecBlockDrafter(nn.Module):
    """See the module docstring. Built from the target's config, embedding [V,H], LM head [V,H] and d2t."""

    def __init__(
        self,
        cfg: SpecBlockConfig,
        target_config: PretrainedConfig,
        embed_weight: Tensor,
        lm_head_weight: Tensor,
        d2t: Tensor | None = None,
    ):
        super().__init__()
        lcfg = drafter_layer_config(target_config, cfg.num_layers)
        H, V = lcfg.hidden_size, lcfg.vocab_size
        d2t = resolve_vocab_map(d2t, cfg.draft_vocab_size, V)
        if d2t.numel() < RANK_SOFTMAX_TOPK:
            raise ValueError(f"the rank features need a draft vocabulary of >= {RANK_SOFTMAX_TOPK} tokens")
        if tuple(embed_weight.shape) != (V, H):
            raise ValueError(f"embed_weight is {tuple(embed_weight.shape)}, the target config says {(V, H)}")
        self.cfg, self.block_size, self.hidden_size = cfg, cfg.block_size, H
        self.feature_size = cfg.num_feature_layers * H
        self.embed_tokens = frozen_embedding(embed_weight)
        self.condition_proj = nn.Linear(self.feature_size, H, bias=False)
        self.slot_queries = nn.Embedding(cfg.block_size, H)
        nn.init.normal_(self.slot_queries.weight, std=SLOT_QUERY_STD)
        self.fusion = SlotFusion(H, lcfg.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(lcfg) for _ in range(cfg.num_layers))
        self.shift_proj = nn.ModuleList(_shift_projection(H) for _ in range(cfg.num_layers - 1))
        self.norm = RMSNorm(H, eps=lcfg.rms_norm_eps)
        self.lm_head = draft_lm_head(lm_head_weight, d2t)
        self.rank_head = RankHead(H, cfg)
        self.rotary = Rotary(lcfg)
        self.register_buffer("d2t", d2t)
        self.register_buffer("t2d", t2d_from_d2t(d2t, V))

    @property
    def decoder_layers(self) -> list[DecoderLayer]:
        return list(self.layers)

    # ------------------------------------------------------------ training

    def forward(
        self,
        features: Tensor,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        position_offset: int = 0,
        source_slots: Sequence[int] | None = None,
    ) -> DrafterOutput | list[DrafterOutput]:
        """Block 1. features [B,T,F*H]; input_ids [B,T] aligned (= the target's tokens t+1);
        attention_mask [B,T] (1 = real token) -> logits [B,T,K,Vd], hidden [B,T,K,H], rank [B,T,K,C].
        With source_slots (even empty): forward_blocks' list, through forward so that DDP / DeepSpeed
        wrappers see the call."""
        blocks = self.forward_blocks(features, input_ids, attention_mask, source_slots or (), position_offset)
        return blocks[0] if source_slots is None else blocks

    def forward_blocks(
        self,
        features: Tensor,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        source_slots: Sequence[int] = (),
        position_offset: int = 0,
    ) -> list[DrafterOutput]:
        """Block 1, then one more block per entry m of source_slots, started from slot m of the block
        before (multi-block TTT, teacher-forced tokens). Block b's offset is block_offsets(...)[b]."""
        B, T, _ = features.shape
        valid = None if attention_mask is None else attention_mask.bool()
        cond, offset, extra, seen, outputs = self.condition_proj(features), 0, None, [], []
        for b, m in enumerate([*source_slots, None]):  # m: the slot the next block starts from
            if b == 0:  # None: causal over the flat grid (grid_mask)
                mask = grid_mask(T, self.block_size, valid, B, features.device)
            else:  # [B,1,TK,(b+1)TK] over [earlier blocks ; own]
                mask = torch.cat([*seen, self._mask(T, valid, earlier=False, same_slots=None, B=B)], dim=-1)
            pos = position_ids(1 + offset + position_offset, B, T, features.device)  # [B,T] slot-0 ids
            hidden, kv = self._block(cond, shift_left(input_ids, offset), pos, mask, extra)
            outputs.append(self._heads(hidden))
            if m is None:
                break
            if not 0 <= m < self.block_size:
                raise ValueError(f"source slot {m} is outside the block (K={self.block_size})")
            seen.append(self._mask(T, valid, earlier=b == 0, same_slots=m + 1, B=B))
            extra = kv  # every block so far: the keys this block attended to
            cond, offset = hidden[:, :, m], offset + m + 1
        return outputs

    def _mask(self, T: int, valid: Tensor | None, *, earlier: bool, same_slots: int | None, B: int) -> Tensor:
        mask = slot_mask(
            T, self.block_size, valid, earlier=earlier, same_slots=same_slots, device=self.d2t.device
        )
        return mask.expand(B, -1, -1, -1)  # [B,1,TK,TK]

    # ------------------------------------------------------------ shared trunk and heads

    def _block(
        self, cond: Tensor, tokens: Tensor, pos: Tensor, mask: Tensor, extra: list[KV] | None
    ) -> tuple[Tensor, list[KV]]:
        """cond [B,N,H], tokens [B,N], pos [B,N] RoPE id of slot 0, mask [B,1,NK,E+NK] (None: causal, no
        extra), extra: per-layer KV of E earlier entries -> hidden [B,N,K,H] (pre-norm) and the per-layer KV
        of [extra ; this block] [B,Hkv,E+NK,hd]."""
        B, N, H = cond.shape
        K = self.block_size
        queries = self.slot_queries(torch.arange(K, device=cond.device))  # [K,H]
        x = self.fusion(cond, self.embed_tokens(tokens).to(cond.dtype), queries)  # [B,N,K,H]
        pos = (pos[:, :, None] + torch.arange(K, device=pos.device)).flatten(1)  # [B,NK]
        rope = self.rotary(x, pos)
        h, kvs = x.flatten(1, 2), []  # [B,NK,H]
        for i, layer in enumerate(self.layers):
            if i > 0:
                h = layer_shift(h.view(B, N, K, H), self.shift_proj[i - 1]).flatten(1, 2)
            h, kv = layer(h, rope, mask, None if extra is None else extra[i])
            kvs.append(kv)
        return h.view(B, N, K, H), kvs

    def _heads(self, hidden: Tensor) -> DrafterOutput:
        normed = self.norm(hidden)  # [B,N,K,H]
        logits = self.lm_head(normed)  # [B,N,K,Vd]
        return DrafterOutput(logits=logits, hidden=hidden, rank_logits=self.rank_head(normed, logits))

    # ------------------------------------------------------------ inference

    def extend(
        self,
        condition: Tensor,
        tokens: Tensor,
        past: DraftCache | None = None,
        *,
        position: int | Tensor = 0,
        offset: int = 0,
        inherited: bool = False,
        last_only: bool = False,
    ) -> DraftStep:
        """Drafts blocks at N consecutive positions position..position+N-1 that see every visible cache
        entry, the earlier new positions' slots, and their own slots causally.
        condition [B,N,F*H] target features (or [B,N,H] pre-norm drafter hidden if inherited); tokens
        [B,N]; position: int or [B] context index of the first condition; offset: the block's token
        offset (0 for block 1). Returns logits [B,N,K,Vd], hidden [B,N,K,H], rank_logits [B,N,K,C] and
        the cache with this call's N*K entries appended (crop them away when they should not stay
        visible). last_only: the outputs of the last position only (N = 1 in those shapes; the cache
        still gets every position's entries): a decoding loop appending a prompt or verified tokens
        drafts from the last one, and the heads over the others would be wasted."""
        cond = self._condition(condition, inherited)
        B, N, _ = cond.shape
        own = slot_mask(N, self.block_size, None, earlier=True, same_slots=None, device=cond.device)
        mask = own.expand(B, -1, -1, -1) if past is None else past.key_mask(own)
        extra = None if past is None else [past.layer(i) for i in range(len(self.layers))]
        pos = position_ids(position, B, N, cond.device) + 1 + offset
        hidden, kv = self._block(cond, tokens, pos, mask, extra)
        out = self._heads(hidden[:, -1:] if last_only else hidden)
        cache = DraftCache.from_kv(kv) if past is None else past.grown(kv)
        return DraftStep(out.logits, out.hidden, out.rank_logits, cache)

    def draft(
        self,
        condition: Tensor,
        token: Tensor,
        past: DraftCache | None = None,
        *,
        position: int | Tensor = 0,
        offset: int = 0,
        inherited: bool = False,
    ) -> DraftStep:
        """One block at one position per row. condition [B,F*H] (or [B,H] if inherited), token [B] ->
        logits [B,K,Vd], hidden [B,K,H], rank_logits [B,K,C], cache with the block's K entries appended.
        Block 1 at context position t: past = block-1 entries of positions < t. A block started from
        slot m of the block just drafted: past.crop(len(past) - K + m + 1), condition = its hidden[:, m],
        token = the token chosen at slot m, offset = previous offset + m + 1, inherited=True.
        A shared `past` (DraftCache.shared: one copy of the entries, a visibility row per leaf) runs the
        B blocks as one row of B*K queries, each block seeing its row's entries and its own slots."""
        if past is not None and past.shared():
            return self._draft_rows(condition, token, past, position + offset, inherited)
        step = self.extend(
            condition[:, None], token[:, None], past, position=position, offset=offset, inherited=inherited
        )
        return DraftStep(step.logits[:, 0], step.hidden[:, 0], step.rank_logits[:, 0], step.cache)

    def _draft_rows(
        self, condition: Tensor, token: Tensor, past: DraftCache, start: int | Tensor, inherited: bool
    ) -> DraftStep:
        """`draft` over a shared cache: condition [n,*], token [n], start: position + offset per row."""
        cond = self._condition(condition, inherited)[None]  # [1,n,H]: the n blocks as n "positions"
        n = cond.shape[1]
        own = slot_mask(n, self.block_size, None, earlier=False, same_slots=None, device=cond.device)
        pos = row_starts(start, n, cond.device) + 1  # [1,n] RoPE id of each block's slot 0
        extra = [past.layer(i) for i in range(len(self.layers))]
        hidden, kv = self._block(cond, token[None], pos, past.rows_mask(own), extra)
        out = self._heads(hidden)
        return DraftStep(out.logits[0], out.hidden[0], out.rank_logits[0], past.grown_rows(kv))

    def _condition(self, condition: Tensor, inherited: bool) -> Tensor:
        expected = self.hidden_size if inherited else self.feature_size
        if condition.shape[-1] != expected:
            kind = "an inherited hidden state" if inherited else "target features"
            raise ValueError(f"condition has width {condition.shape[-1]}, {kind} need {expected}")
        return condition if inherited else self.condition_proj(condition)
