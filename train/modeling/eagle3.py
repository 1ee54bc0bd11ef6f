"""The EAGLE-3 baseline drafter (docs/specblock.md 1.8; SafeAILab/EAGLE `eagle/traineagle3/cnets.py`).

One decoder layer `midlayer` whose attention reads [RMSNorm(embed(token)) ; RMSNorm(hidden)] (2H) and
whose residual stream is `hidden`; `fc` projects the target's low|mid|high features (F*H -> H).

Training-time test (TTT), K = ttt_length steps over the same sequence:
  step 0: hidden = fc(features[:, t]), token = input_ids[:, t] (aligned: the target's token t+1);
  step s: hidden = the layer's output of step s-1 at the same position t, token = input_ids[:, t+s].
Step s at position t predicts token t+2+s (DrafterOutput slot k = step k) and attends to the step-0 keys
of the non-padding positions <= t (the cached context) plus its own earlier steps' keys at position t
(the diagonal), as cnets does. RoPE ids follow cnets: t + s (+ position_offset).
Parameter names follow EAGLE-3 checkpoints (fc, midlayer.{input_layernorm, hidden_norm, self_attn, ...},
norm, lm_head, d2t, t2d), except that d2t holds target ids, not EAGLE's offsets.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn
from transformers import LlamaConfig, PretrainedConfig

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


@dataclass
class Eagle3Config(DrafterConfig):
    """ttt_length: TTT steps K unrolled in training (EAGLE-3 trains 7). The fields every drafter has:
    `DrafterConfig`."""

    name: str = "eagle3"
    ttt_length: int = 7

    def __post_init__(self):
        super().__post_init__()
        if self.ttt_length < 1:
            raise ValueError(f"ttt_length must be >= 1, got {self.ttt_length}")


class Eagle3Layer(DecoderLayer):
    """EAGLE-3's midlayer: attention over [input_layernorm(emb) ; hidden_norm(h)], residual h."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__(cfg, attn_in=2 * cfg.hidden_size)
        self.hidden_norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def forward(
        self, emb: Tensor, h: Tensor, rope: tuple[Tensor, Tensor], mask: Tensor, extra: KV | None = None
    ) -> tuple[Tensor, KV]:
        """emb, h [B,L,H] -> (h [B,L,H], the kv [extra ; own] it attended to)."""
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(h)], dim=-1)  # [B,L,2H]
        return self.attend(h, x, rope, mask, extra)

    def target_key(self, name: str) -> str | None:
        """The target layer's input norm starts the hidden half's norm; the embedding half's norm keeps
        its own (ones): a target layer never reads token embeddings there."""
        if name.startswith("input_layernorm."):
            return None
        return name.replace("hidden_norm.", "input_layernorm.", 1)


class Eagle3Drafter(nn.Module):
    """See the module docstring. Built from the target's config, embedding [V,H], LM head [V,H] and d2t."""

    def __init__(
        self,
        cfg: Eagle3Config,
        target_config: PretrainedConfig,
        embed_weight: Tensor,
        lm_head_weight: Tensor,
        d2t: Tensor | None = None,
    ):
        super().__init__()
        lcfg = drafter_layer_config(target_config, 1)
        H, V = lcfg.hidden_size, lcfg.vocab_size
        d2t = resolve_vocab_map(d2t, cfg.draft_vocab_size, V)
        if tuple(embed_weight.shape) != (V, H):
            raise ValueError(f"embed_weight is {tuple(embed_weight.shape)}, the target config says {(V, H)}")
        self.cfg, self.block_size, self.hidden_size = cfg, cfg.ttt_length, H
        self.feature_size = cfg.num_feature_layers * H
        self.embed_tokens = frozen_embedding(embed_weight)
        self.fc = nn.Linear(self.feature_size, H, bias=False)
        self.midlayer = Eagle3Layer(lcfg)
        self.norm = RMSNorm(H, eps=lcfg.rms_norm_eps)
        self.lm_head = draft_lm_head(lm_head_weight, d2t)
        self.rotary = Rotary(lcfg)
        self.register_buffer("d2t", d2t)
        self.register_buffer("t2d", t2d_from_d2t(d2t, V))

    @property
    def decoder_layers(self) -> list[DecoderLayer]:
        return [self.midlayer]

    def forward(
        self,
        features: Tensor,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        position_offset: int = 0,
    ) -> DrafterOutput:
        """features [B,T,F*H]; input_ids [B,T] aligned; attention_mask [B,T] -> logits [B,T,K,Vd],
        hidden [B,T,K,H] (step k's layer output), rank_logits None."""
        B, T, _ = features.shape
        valid = None if attention_mask is None else attention_mask.bool()
        causal = grid_mask(T, 1, valid, B, features.device)  # None: plain causal (right padding)
        diagonal = slot_mask(T, 1, None, earlier=False, same_slots=None, device=features.device)
        h, extra, states = self.fc(features), None, []
        for s in range(self.block_size):
            mask = causal  # step 0; later steps: [B,1,T,(s+1)T] over [step-0 keys ; steps 1..s]
            if s > 0:
                if causal is None:
                    causal = slot_mask(T, 1, valid, earlier=True, same_slots=None, device=features.device)
                mask = torch.cat([causal.expand(B, -1, -1, -1)] + [diagonal.expand(B, -1, -1, -1)] * s, -1)
            pos = position_ids(s + position_offset, B, T, features.device)  # [B,T]
            h, kv = self._step(h, shift_left(input_ids, s), pos, mask, extra)
            extra = [kv]  # steps 0..s: the keys this step attended to
            states.append(h)
        hidden = torch.stack(states, dim=2)  # [B,T,K,H]
        return DrafterOutput(logits=self.lm_head(self.norm(hidden)), hidden=hidden, rank_logits=None)

    def _step(
        self, h: Tensor, tokens: Tensor, pos: Tensor, mask: Tensor, extra: list[KV] | None
    ) -> tuple[Tensor, KV]:
        """h [B,L,H], tokens [B,L], pos [B,L], mask [B,1,L,E+L] -> h [B,L,H] and the kv it attended to,
        [extra ; own] [B,Hkv,E+L,hd]."""
        emb = self.embed_tokens(tokens).to(h.dtype)
        return self.midlayer(emb, h, self.rotary(h, pos), mask, None if extra is None else extra[0])

    def extend(
        self,
        condition: Tensor,
        tokens: Tensor,
        past: DraftCache | None = None,
        *,
        position: int | Tensor = 0,
        last_only: bool = False,
    ) -> DraftStep:
        """Step 0 at N consecutive context positions position..position+N-1 (how a decoding loop appends
        the tokens a verification accepted): condition [B,N,F*H] target features, tokens [B,N] aligned;
        each position sees every visible cache entry and the earlier new positions. Returns logits
        [B,N,1,Vd], hidden [B,N,1,H] (one step: K' = 1), no rank logits, and the cache with the N step-0
        entries appended. last_only: the outputs of the last position only (N = 1 in those shapes; the
        cache still gets every position's entries), as a decoding loop drafts from the last one."""
        if condition.shape[-1] != self.feature_size:
            raise ValueError(f"condition has width {condition.shape[-1]}, expected {self.feature_size}")
        B, N, _ = condition.shape
        own = slot_mask(N, 1, None, earlier=True, same_slots=None, device=condition.device)
        mask = own.expand(B, -1, -1, -1) if past is None else past.key_mask(own)
        pos = position_ids(position, B, N, condition.device)
        h, kv = self._step(self.fc(condition), tokens, pos, mask, None if past is None else [past.layer(0)])
        past = DraftCache.from_kv([kv]) if past is None else past.grown([kv])
        if last_only:
            h = h[:, -1:]
        return DraftStep(self.lm_head(self.norm(h))[:, :, None], h[:, :, None], None, past)

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
        """One drafting step per row that sees every visible cache entry and itself, at RoPE id
        position + offset (step s at context position t: t + s).
        condition [B,F*H] target features (step 0, at context position t: position = t, past = step-0
        entries of positions < t) or [B,H] the previous step's hidden (inherited=True, offset = s,
        past = step-0 entries of positions <= t + the path's earlier steps); token [B].
        Returns logits [B,1,Vd], hidden [B,1,H], no rank logits, and the cache with this step's entry
        appended. A shared `past` (DraftCache.shared) runs the B rows as one row of B queries."""
        expected = self.hidden_size if inherited else self.feature_size
        if condition.shape[-1] != expected:
            raise ValueError(f"condition has width {condition.shape[-1]}, expected {expected}")
        if past is not None and past.shared():  # one copy of the entries: the rows as one row of B
            h = (condition if inherited else self.fc(condition))[None]  # [1,B,H]
            B = h.shape[1]
            own = slot_mask(B, 1, None, earlier=False, same_slots=None, device=h.device)  # each sees itself
            pos = row_starts(position + offset, B, h.device)
            h, kv = self._step(h, token[None], pos, past.rows_mask(own), [past.layer(0)])
            return DraftStep(
                self.lm_head(self.norm(h[0]))[:, None], h[0][:, None], None, past.grown_rows([kv])
            )
        h = (condition if inherited else self.fc(condition))[:, None]  # [B,1,H]
        own = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=h.device)
        mask = own.expand(h.shape[0], -1, -1, -1) if past is None else past.key_mask(own)
        pos = position_ids(position + offset, h.shape[0], 1, h.device)
        h, kv = self._step(h, token[:, None], pos, mask, None if past is None else [past.layer(0)])
        past = DraftCache.from_kv([kv]) if past is None else past.grown([kv])
        return DraftStep(self.lm_head(self.norm(h)), h, None, past)
