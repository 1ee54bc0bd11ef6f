"""Pieces shared by the drafters: the config every drafter's extends, the output types, the
target-derived layer config, a small attention block, the slot masks, the inference KV cache, and the
frozen embedding / draft LM head.

What a drafter module offers (the training and evaluation stages rely on nothing else):
- attributes `cfg` (its `DrafterConfig` subclass), `block_size` (K: the positions one training forward
  predicts), `d2t` [Vd] (draft id -> target id), `t2d` [V] and `lm_head` (Linear(H, Vd));
- `forward(features [B,T,F*H], input_ids [B,T], attention_mask [B,T]) -> DrafterOutput` (training);
- optionally `decoder_layers` (its `DecoderLayer`s, bottom to top), which `init_layers=target` starts from
  the target's top layers (`start_from_target_layers`);
- `extend(condition [B,N,F*H], tokens [B,N], past, *, position) -> DraftStep` over N consecutive context
  positions, and `draft(condition [B,H] or [B,F*H], token [B], past, *, position, offset, inherited)
  -> DraftStep` at one position per row (decoding; evaluate/decoding/drafting.py).

Why our own attention block instead of transformers' `LlamaDecoderLayer`: both drafters attend to keys
that do not come from the same call (earlier blocks or TTT steps, an inference cache cropped to a
slot), under masks no HF mask helper builds, and EAGLE-3's q/k/v read 2H inputs. A 40-line block that
takes explicit extra keys and a boolean mask [B|1, 1, Lq, Lk] says this directly; it reuses HF's RMSNorm,
MLP, RoPE and GQA helpers and keeps HF parameter names (`self_attn.q_proj`, `mlp.gate_proj`, ...), so
exported weights load into Llama-style layers. Attention runs through `F.scaled_dot_product_attention`
with that boolean mask (True = may attend).

Flat layout: a block of N positions x K slots is flattened position-major, flat index = n*K + k.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import LlamaConfig, PretrainedConfig
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
    repeat_kv,
)

RMSNorm = LlamaRMSNorm
Rotary = LlamaRotaryEmbedding
KV = tuple[Tensor, Tensor]  # keys, values [B, Hkv, L, head_dim], RoPE already applied to the keys


@dataclass
class DrafterConfig:
    """What every drafter's config holds; each drafter subclasses it with its architecture's fields, and
    the subclass is that drafter's Hydra schema in the `drafter` group (train/drafters.py).

    name: the drafter's registered name (the subclass's default); draft_vocab_size: None = the target's
    full vocabulary; num_feature_layers: how many target hidden states `features` concatenates (F), set
    from the target's feature layers when the training stage builds the drafter."""

    name: str = ""
    draft_vocab_size: int | None = None
    num_feature_layers: int = 3

    def __post_init__(self):
        if self.num_feature_layers < 1:
            raise ValueError(f"num_feature_layers must be >= 1, got {self.num_feature_layers}")


@dataclass
class DrafterOutput:
    """logits [B,S,K,Vd] (slot k at context position t predicts token t+2+k); hidden [B,S,K,H] pre-norm
    states (cross-block inheritance, EAGLE TTT); rank_logits [B,S,K,C] or None."""

    logits: Tensor
    hidden: Tensor
    rank_logits: Tensor | None = None


class DraftStep(NamedTuple):
    """What a drafter's inference calls (`extend`, `draft`) return, the same for every drafter: per row
    (and position) the K' tokens one call drafts (SpecBlock: a block's K slots; EAGLE-3: one step, K' = 1)
    as logits [..., K', Vd], pre-norm hidden states [..., K', H] (what later blocks / steps start from)
    and rank_logits [..., K', C] or None, plus the cache with this call's entries appended."""

    logits: Tensor
    hidden: Tensor
    rank_logits: Tensor | None
    cache: DraftCache


# ---------------------------------------------------------------- config from the target


def _rope_parameters(text_config: PretrainedConfig) -> dict:
    """The target's RoPE settings as transformers-5 `rope_parameters`; per-layer-type dicts (Gemma-3
    style) give their full-attention entry; configs without any give default RoPE with `rope_theta`."""
    params = getattr(text_config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_type" not in params and "full_attention" in params:
        params = params["full_attention"]
    if not params:
        params = {"rope_type": "default", "rope_theta": getattr(text_config, "rope_theta", 10000.0)}
    return dict(params)


def drafter_layer_config(target_config: PretrainedConfig, num_layers: int) -> LlamaConfig:
    """A Llama config for the drafter's layers with the target's widths, heads, norm eps and RoPE, so a
    Llama / Qwen / Mistral-style target works. The drafter is Llama-style whatever the target is
    (no q/k norms, no attention bias)."""
    tc = target_config.get_text_config()
    heads = tc.num_attention_heads
    return LlamaConfig(
        vocab_size=tc.vocab_size,
        hidden_size=tc.hidden_size,
        intermediate_size=tc.intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=getattr(tc, "num_key_value_heads", None) or heads,
        head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // heads,
        hidden_act=getattr(tc, "hidden_act", "silu"),
        rms_norm_eps=tc.rms_norm_eps,
        max_position_embeddings=tc.max_position_embeddings,
        rope_parameters=_rope_parameters(tc),
    )


# ---------------------------------------------------------------- attention and layer


class Attention(nn.Module):
    """Multi-head GQA self-attention over [extra keys ; own keys] with an explicit boolean mask."""

    def __init__(self, cfg: LlamaConfig, in_features: int):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.num_heads, self.num_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.q_proj = nn.Linear(in_features, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(in_features, self.num_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(in_features, self.num_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)

    def forward(
        self, x: Tensor, rope: tuple[Tensor, Tensor], mask: Tensor, extra: KV | None = None
    ) -> tuple[Tensor, KV]:
        """x [B,L,Din]; rope (cos, sin) [B,L,hd]; mask [B|1,1,L,N+L] bool over [extra (N) ; own (L)] keys,
        or None for the plain causal mask over own keys (then extra must be None, see `grid_mask`);
        extra: keys/values [B,Hkv,N,hd] or None. Returns out [B,L,H] and the keys/values it attended to,
        [extra ; own] [B,Hkv,N+L,hd] (what a cache or a later block reads next, not concatenated again)."""
        B, L, _ = x.shape
        q = self.q_proj(x).view(B, L, -1, self.head_dim).transpose(1, 2)  # [B,Hq,L,hd]
        k = self.k_proj(x).view(B, L, -1, self.head_dim).transpose(1, 2)  # [B,Hkv,L,hd]
        v = self.v_proj(x).view(B, L, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, *rope)
        if mask is None and extra is not None:
            raise ValueError("a causal (mask=None) call attends to its own keys only")
        keys, values = (k, v) if extra is None else (torch.cat([extra[0], k], 2), torch.cat([extra[1], v], 2))
        seen = (keys, values)
        groups = self.num_heads // self.num_kv
        if torch.is_grad_enabled():  # training: every key head repeated for its query heads
            keys, values = repeat_kv(keys, groups), repeat_kv(values, groups)
        elif mask is not None and q.dtype in HALF_DTYPES and L <= SMALL_QUERY_ROWS:
            out = small_query_attention(q, keys, values, mask, groups)  # a decoding step in bf16 / fp16
            return self.o_proj(out.transpose(1, 2).reshape(B, L, -1)), seen
        # without gradients (decoding) the kernel reads each key head for its group instead of copies of
        # the whole cache: bitwise the same output, tested
        out = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, is_causal=mask is None, enable_gqa=True
        )  # [B,Hq,L,hd]
        return self.o_proj(out.transpose(1, 2).reshape(B, L, -1)), seen


# A decoding step in bf16 / fp16 with at most SMALL_QUERY_ROWS queries (a drafted block's K slots at one or
# two positions, an EAGLE-3 step): two batched products and a float32 softmax, the query heads of a group
# stacked as rows of their key head, beat the CPU's fused kernel, which splits its work by query block.
# Measured on the AMD EPYC of session 19 (bf16, 2 threads, 9 query / 3 key heads of 64, 1,608 cached keys):
# 1 / 8 / 16 queries in 0.10 / 0.20 / 0.33 ms against 0.81 / 0.38 / 0.60 fused; 64 queries 5.4 against 2.1.
HALF_DTYPES = (torch.bfloat16, torch.float16)
SMALL_QUERY_ROWS = 16


def small_query_attention(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor, groups: int) -> Tensor:
    """softmax(q k^T / sqrt(hd) + mask) v without gradients. q [B,Hq,L,hd], keys/values [B,Hkv,N,hd],
    mask [B|1,1,L,N] bool (True = attend; every row sees a key) -> [B,Hq,L,hd]. Query head h reads key
    head h // groups (repeat_kv's order); the scores are rounded to q's dtype, the softmax runs in float32."""
    B, Hq, L, hd = q.shape
    Hkv, N = keys.shape[1], keys.shape[2]
    rows = q.reshape(B, Hkv, groups * L, hd)  # a group's query heads as rows of its key head
    seen = mask.expand(mask.shape[0], 1, L, N)[:, :, None].expand(-1, 1, groups, L, N)
    scores = torch.matmul(rows, keys.transpose(-1, -2)).float().mul_(hd**-0.5)
    scores.masked_fill_(~seen.reshape(-1, 1, groups * L, N), float("-inf"))
    weights = scores.softmax(-1).to(values.dtype)
    return torch.matmul(weights, values).reshape(B, Hq, L, hd)


class DecoderLayer(nn.Module):
    """Pre-norm Llama layer (attention + SwiGLU MLP, residuals) over explicit extra keys."""

    def __init__(self, cfg: LlamaConfig, attn_in: int | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, attn_in or cfg.hidden_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(
        self, h: Tensor, rope: tuple[Tensor, Tensor], mask: Tensor, extra: KV | None = None
    ) -> tuple[Tensor, KV]:
        """h [B,L,H] -> (h [B,L,H], the kv [extra ; own] it attended to)."""
        return self.attend(h, self.input_layernorm(h), rope, mask, extra)

    def attend(
        self, residual: Tensor, attn_in: Tensor, rope: tuple[Tensor, Tensor], mask: Tensor, extra: KV | None
    ) -> tuple[Tensor, KV]:
        out, kv = self.self_attn(attn_in, rope, mask, extra)
        h = residual + out
        return h + self.mlp(self.post_attention_layernorm(h)), kv

    def load_target_layer(self, target_layer: nn.Module) -> None:
        """Starts this layer as a copy of a Llama-style decoder layer of the target (the same parameter
        names; what only the target has, e.g. Qwen3's q/k norms, is not read). A projection that reads a
        wider input than the target's (EAGLE-3's [embedding ; hidden]) gets the target's weights on its
        last columns, the hidden half, and keeps its own initialisation on the rest. One error names the
        parameters the target lacks or whose shapes do not fit."""
        theirs = target_layer.state_dict()
        wrong = []
        with torch.no_grad():
            for name, param in self.named_parameters():
                key = self.target_key(name)
                if key is None:
                    continue
                src = theirs.get(key)
                if src is not None and src.shape == param.shape:
                    param.copy_(src)
                elif src is not None and wider(src, param):
                    param[:, -src.shape[1] :].copy_(src)  # the hidden half of a wider input
                else:
                    there = "missing" if src is None else str(tuple(src.shape))
                    wrong.append(f"{name} ({there} in the target, {tuple(param.shape)} here)")
        if wrong:
            raise ValueError(f"the target's decoder layer does not fit the drafter's: {'; '.join(wrong)}")

    def target_key(self, name: str) -> str | None:
        """The target layer's parameter this layer's `name` starts from (None: keep its own)."""
        return name


def start_from_target_layers(drafter: nn.Module, target_layers: nn.ModuleList) -> list[int]:
    """Copies the target's top decoder layers into the drafter's (`drafter.decoder_layers`, bottom to
    top: drafter layer i starts as target layer L - n + i of L) and returns the target layer indices.
    The top layers are the ones whose output the target's norm and LM head read, as the drafter's is."""
    layers = getattr(drafter, "decoder_layers", None)
    if layers is None:
        raise ValueError(f"{type(drafter).__name__} names no decoder_layers to start from the target's")
    n, L = len(layers), len(target_layers)
    if n > L:
        raise ValueError(f"the drafter has {n} decoder layers, the target {L}")
    for layer, source in zip(layers, target_layers[L - n :]):
        layer.load_target_layer(source)
    return list(range(L - n, L))


def wider(src: Tensor, param: Tensor) -> bool:
    """Whether `param` [out, in'] reads a wider input than `src` [out, in] (in < in')."""
    return (
        src.dim() == 2
        and param.dim() == 2
        and src.shape[0] == param.shape[0]
        and src.shape[1] < param.shape[1]
    )


# ---------------------------------------------------------------- masks


def slot_mask(
    T: int,
    K: int,
    key_valid: Tensor | None = None,
    *,
    earlier: bool,
    same_slots: int | None,
    device: torch.device | None = None,
) -> Tensor:
    """Boolean mask [B|1, 1, T*K, T*K] between two flat blocks of T positions x K slots.

    Query (t, s) may see key (t', k') iff
      earlier and t' < t and key_valid[t']            (every slot of an earlier, non-padding position), or
      t' == t and k' <= s     (same_slots None: causal over the slots of its own position), or
      t' == t and k' < same_slots                     (a fixed prefix of another block's slots).
    A query always sees its own position's slot 0 when same_slots is None, so no row is empty.
    With K = 1 this is the usual causal mask (earlier=True) or the diagonal (earlier=False).
    """
    pos = torch.arange(T, device=device).repeat_interleave(K)  # [T*K] position of each flat index
    slot = torch.arange(K, device=device).repeat(T)  # [T*K] slot of each flat index
    same_pos = pos[:, None] == pos[None, :]
    limit = slot[:, None] if same_slots is None else torch.full_like(slot[:, None], same_slots - 1)
    mask = (same_pos & (slot[None, :] <= limit))[None]  # [1,TK,TK]
    if earlier:
        prior = (pos[None, :] < pos[:, None])[None]  # [1,TK,TK]
        if key_valid is not None:
            prior = prior & key_valid.bool().repeat_interleave(K, dim=1)[:, None, :]  # [B,TK,TK]
        mask = mask | prior
    return mask[:, None]


def right_padded(key_valid: Tensor | None) -> bool:
    """True when every row of key_valid [B,T] is ones then zeros (or there is no mask)."""
    return key_valid is None or bool((key_valid[:, 1:] <= key_valid[:, :-1]).all())


def grid_mask(T: int, K: int, key_valid: Tensor | None, B: int, device: torch.device) -> Tensor | None:
    """The first block's mask (`slot_mask(..., earlier=True, same_slots=None)`, expanded to [B,1,TK,TK]),
    or None (= plain causal attention, which kernels run without a mask and skip the masked half of) where
    that is the same for every real query. Flat index n*K + k is position-major, so "every slot of an
    earlier position, or a slot <= s of its own" is exactly "flat key index <= flat query index". The
    mask differs only by hiding padding keys, which under right padding lie after every real query;
    padding queries then see more keys, but their outputs feed nothing that is trained."""
    if right_padded(key_valid):
        return None
    return slot_mask(T, K, key_valid, earlier=True, same_slots=None, device=device).expand(B, -1, -1, -1)


def shift_left(x: Tensor, offset: int, fill: float | int = 0) -> Tensor:
    """x [B,T,...] -> y with y[:, t] = x[:, t+offset], `fill` past the end (how later blocks / TTT steps
    read tokens, and how the trainer must shift targets and masks by the same offsets)."""
    if offset == 0:
        return x
    tail = torch.full_like(x[:, :offset], fill)
    return torch.cat([x[:, offset:], tail], dim=1)[:, : x.shape[1]]


# ---------------------------------------------------------------- inference cache


@dataclass
class DraftCache:
    """Keys/values a drafted block attends to, per layer [B, Hkv, N, head_dim] (RoPE applied), in the
    order they were produced. `visible` [B, N] bool hides entries per row (None = all visible).

    Every entry is visible to the next call (unless hidden). So the caller keeps exactly the keys the
    next draft should see: the committed context (SpecBlock: block 1's K slots of every verified
    position, position-major; EAGLE-3: step 0 of every verified position) followed, while expanding a
    tree, by the same-position slots of the blocks/steps on the path to the current leaf.
    `crop(n)` drops everything after entry n: back to the committed context, or to "block 1 up to slot
    m" (n = committed*K + m + 1 right after drafting block 1 at the last position). `rows(idx)` selects
    or repeats batch rows, one per leaf to expand.

    Shared rows: a cache whose entries are stored once (batch 1) with a `visible` row per leaf [n, N]
    (`shared()`) stands for n caches that differ only in what they hide. `rows` of a batch-1 cache gives
    that form without copying the entries, and a drafter's `draft` over it runs the n leaves as one row
    of n*K' queries (`rows_mask`, `grown_rows`): the committed context is neither copied per leaf nor
    attended to in n separate batch rows.
    """

    keys: list[Tensor]
    values: list[Tensor]
    visible: Tensor | None = None

    def __len__(self) -> int:
        return self.keys[0].shape[2]

    def crop(self, n: int) -> DraftCache:
        vis = None if self.visible is None else self.visible[:, :n]
        return DraftCache([k[:, :, :n] for k in self.keys], [v[:, :, :n] for v in self.values], vis)

    def rows(self, index: Tensor) -> DraftCache:
        """Rows `index` (selected or repeated). A batch-1 cache keeps its one copy of the entries and
        gives each row its own visibility (the shared form); a batch-n cache copies the rows."""
        if not self.keys:  # a drafter without attention layers keeps nothing
            return self
        if self.keys[0].shape[0] == 1:
            vis = self.visible if self.visible is not None else self.all_visible(1)
            return DraftCache(
                self.keys, self.values, vis[torch.zeros_like(index) if vis.shape[0] == 1 else index]
            )
        vis = None if self.visible is None else self.visible[index]
        return DraftCache([k[index] for k in self.keys], [v[index] for v in self.values], vis)

    def shared(self) -> bool:
        """Whether several rows share one stored copy of the entries (keys batch 1, `visible` [n, N])."""
        return (
            bool(self.keys)
            and self.keys[0].shape[0] == 1
            and self.visible is not None
            and self.visible.shape[0] > 1
        )

    def unshared(self) -> DraftCache:
        """A shared cache as n batch rows holding copies of the entries (the plain form): what a drafter
        whose `draft` does not run shared rows itself calls first (slower: one copy per row)."""
        if not self.shared():
            return self
        n = self.visible.shape[0]
        copies = [[t.expand(n, -1, -1, -1).contiguous() for t in ts] for ts in (self.keys, self.values)]
        return DraftCache(copies[0], copies[1], self.visible)

    def rows_mask(self, own: Tensor) -> Tensor:
        """For a shared cache of n rows whose new queries run as ONE row of n*K' (row b's K' queries
        after row b-1's): own [1,1,nK',nK'] mask among them -> [1,1,nK',N+nK'] over [cache ; new], row b's
        queries seeing the entries row b sees."""
        n, L = self.visible.shape[0], own.shape[-1]
        per_query = self.visible.repeat_interleave(L // n, dim=0)  # [nK', N]
        return torch.cat([per_query[None, None], own], dim=-1)

    def grown_rows(self, kv: list[KV]) -> DraftCache:
        """After a `rows_mask` call (kv: [these entries ; its n*K' new ones], batch 1): row b sees its
        own K' new entries only."""
        n, new = self.visible.shape[0], kv[0][0].shape[2] - len(self)
        own = torch.eye(n, dtype=torch.bool, device=self.visible.device).repeat_interleave(new // n, dim=1)
        return DraftCache([k for k, _ in kv], [v for _, v in kv], torch.cat([self.visible, own], dim=1))

    def all_visible(self, rows: int) -> Tensor:
        """A [rows, N] visibility that hides nothing."""
        return torch.ones(rows, len(self), dtype=torch.bool, device=self.keys[0].device)

    def layer(self, i: int) -> KV:
        return self.keys[i], self.values[i]

    def key_mask(self, own: Tensor) -> Tensor:
        """own [B|1,1,L,L] mask among the new entries -> [B,1,L,N+L] over [cache ; new]."""
        B, L = self.keys[0].shape[0], own.shape[-1]
        if self.shared():
            raise ValueError(
                "a shared cache's rows are drafted through rows_mask / grown_rows, or after unshared()"
            )
        vis = self.visible if self.visible is not None else self.all_visible(B)
        return torch.cat([vis[:, None, None, :].expand(B, 1, L, len(self)), own.expand(B, 1, L, L)], dim=-1)

    def grown(self, kv: list[KV]) -> DraftCache:
        """The cache after a call that attended to it: kv per layer holds [these entries ; the call's new
        ones] (as the attention returns them), kept as they are; the new entries are visible."""
        vis = self.visible
        if vis is not None:
            vis = torch.cat([vis, vis.new_ones(vis.shape[0], kv[0][0].shape[2] - len(self))], dim=1)
        return DraftCache([k for k, _ in kv], [v for _, v in kv], vis)

    @staticmethod
    def from_kv(kv: list[KV]) -> DraftCache:
        return DraftCache([k for k, _ in kv], [v for _, v in kv])


def row_starts(position: int | Tensor, n: int, device: torch.device) -> Tensor:
    """[1, n]: the start position of each of n rows drafted as one row (an int or a [n] tensor)."""
    return torch.as_tensor(position, device=device).reshape(-1).expand(n)[None]


def position_ids(position: int | Tensor, B: int, n: int, device: torch.device) -> Tensor:
    """[B, n] = position + arange(n) for an int or a [B] tensor of start positions."""
    start = torch.as_tensor(position, device=device).reshape(-1, 1).expand(B, 1)
    return start + torch.arange(n, device=device)


# ---------------------------------------------------------------- embedding and head


def frozen_embedding(embed_weight: Tensor) -> nn.Embedding:
    """The target's token embedding [V,H], copied in the default dtype and frozen."""
    weight = embed_weight.detach().clone().to(torch.get_default_dtype())
    return nn.Embedding.from_pretrained(weight, freeze=True)


def draft_lm_head(lm_head_weight: Tensor, d2t: Tensor) -> nn.Linear:
    """Trainable Linear(H, Vd) initialised from the target head's rows d2t ([V,H] -> [Vd,H])."""
    rows = lm_head_weight.detach()[d2t.to(lm_head_weight.device)]
    head = nn.Linear(rows.shape[1], rows.shape[0], bias=False)
    with torch.no_grad():
        head.weight.copy_(rows.to(head.weight.dtype))
    return head
