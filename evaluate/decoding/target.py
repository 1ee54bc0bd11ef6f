"""The frozen target with a KV cache, fed with tree attention (batch 1): the decoding loop's target side.

One forward feeds the root and every draft node after the committed cache (a 4-D mask: each node sees
the cache and its ancestors; position ids = cache length + depth) and returns the target's features and
logits at every node; `keep` then keeps the committed entries, the root and the accepted nodes (prefix
reuse, nothing recomputed).

On a CPU the session's target attends with `grouped_sdpa` (registered with transformers' AttentionInterface
as GROUPED_SDPA) where it ran sdpa: a forward over a few tree nodes under the 4-D mask stacks each key
head's query heads as rows of that head instead of copying the cache once per query head (`repeat_kv`,
what transformers' sdpa does for more than one query with a mask; one query it already packs so). Measured
in bf16 on SmolLM2-135M after a 300-token cache (docs/measured/decoding.md, session 20), and the same
logits (tests/evaluate/test_target_session.py).
"""

from __future__ import annotations

import inspect
import time

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import AttentionInterface
from transformers.cache_utils import DynamicCache, DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from specblock.data.target import FeatureTarget

GROUPED_SDPA = "specblock_grouped_sdpa"
# Above this many queries (a prefill) the stacked rows gain nothing and sdpa's own path runs.
GROUPED_MAX_QUERIES = 64
# what a Llama-style layer passes besides the tensors, none of which changes the attention's math
PLAIN_KWARGS = frozenset(
    {"position_ids", "use_cache", "output_hidden_states", "cache_position", "output_attentions"}
)


def grouped_sdpa(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """transformers' attention signature: query [B,Hq,n,hd], key/value [B,Hkv,N,hd], attention_mask
    [B|1,1,n,N] (additive or bool) -> ([B,n,Hq,hd], None). With grouped query heads, a mask and
    2 <= n <= GROUPED_MAX_QUERIES: one sdpa over [B,Hkv,groups*n,hd] rows (query head h reads key head
    h // groups, repeat_kv's order; the mask repeated per group) instead of over copies of the keys;
    anything else goes to transformers' sdpa as it is."""
    groups = getattr(module, "num_key_value_groups", 1)
    B, Hq, n, hd = query.shape
    plain = groups == 1 or attention_mask is None or not 2 <= n <= GROUPED_MAX_QUERIES
    # a kwarg that changes the math (softcap, sliding_window, position_bias, sinks, ...) is sdpa's to handle
    unknown = any(v is not None and k not in PLAIN_KWARGS for k, v in kwargs.items())
    if plain or unknown or attention_mask.shape[1] != 1 or dropout or module.training:
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            **kwargs,
        )
    rows = query.reshape(B, Hq // groups, groups * n, hd)  # group g's heads: rows r * n + i of key head g
    mask = grouped_mask(attention_mask, B, n, groups)
    out = F.scaled_dot_product_attention(rows, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(B, Hq, n, hd).transpose(1, 2).contiguous(), None


# The last mask grouped_sdpa repeated: (mask, its version counter, groups, the repeated mask).
_LAST_MASK: list = [None, -1, 0, None]


def grouped_mask(mask: Tensor, B: int, n: int, groups: int) -> Tensor:
    """mask [B|1,1,n|1,N] -> [B,1,groups*n,N], row r * n + i reading query i's row. Every layer of one forward
    passes the same mask tensor, so it is repeated once per forward (the last one is kept, keyed by the
    tensor itself and its version counter: a mask written in place between calls is repeated again)."""
    last = _LAST_MASK
    if (
        last[0] is mask
        and last[1] == mask._version
        and last[2] == groups
        and last[3].shape[:3] == (B, 1, groups * n)
    ):
        return last[3]
    out = mask.expand(B, 1, n, -1).repeat(1, 1, groups, 1)
    last[:] = [mask, mask._version, groups, out]
    return out


def forget_grouped_mask() -> None:
    """Empty grouped_mask's cache of the last repeated mask (an A/B of the per-layer repeat uses it)."""
    _LAST_MASK[:] = [None, -1, 0, None]


AttentionInterface.register(GROUPED_SDPA, grouped_sdpa)
# Its masks are sdpa's: without a registered mask function transformers turns no 2-D padding mask into a
# 4-D one for this implementation (a padded call of the same model would attend to its padding).
AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)


def use_grouped_attention(model: torch.nn.Module) -> None:
    """A CPU model on transformers' sdpa attends through `grouped_sdpa` from now on (the same math; the
    plain and speculative loops share the model, so both get it). Other implementations and devices
    are left as they are (a GPU's kernels were not measured with it)."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != "sdpa":
        return
    if next(model.parameters()).device.type != "cpu":
        return
    model.set_attn_implementation(GROUPED_SDPA)


class TargetSession:
    """A frozen causal LM with a DynamicCache, fed with tree attention (batch 1)."""

    def __init__(self, target: FeatureTarget):
        self.target = target
        use_grouped_attention(target.model)
        params = inspect.signature(target.model.base_model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"  # transformers renamed it
        self.cache: DynamicCache | None = None
        self.calls, self.seconds = 0, 0.0  # forwards since reset() and their wall seconds

    def reset(self) -> None:
        self.cache, self.calls, self.seconds = DynamicCache(), 0, 0.0

    def __len__(self) -> int:
        return self.cache.get_seq_length() if self.cache is not None else 0

    @torch.no_grad()
    def forward(
        self, tokens: list[int], parents: list[int] | None = None, last_logits_only: bool = False
    ) -> tuple[Tensor, Tensor]:
        """Feed `tokens` after the cache. parents None: a causal chain; else a tree, parents[n] < n (or -1:
        child of the cache's last token). Returns features [n, F*H] and logits [n, V] float32, or [1, V]
        for the last token only with last_logits_only (a prefill that only samples the next token need
        not pay the LM head's n x H x V multiply-adds over the whole prompt)."""
        n, past = len(tokens), len(self)
        dev = self.target.device
        if parents is None:
            depth = list(range(n))
            own = torch.ones(n, n, dtype=torch.bool).tril()
        else:
            depth, own = [0] * n, torch.zeros(n, n, dtype=torch.bool)
            for i, p in enumerate(parents):
                if p >= 0:
                    depth[i] = depth[p] + 1
                    own[i] = own[p]
                own[i, i] = True
        seen = torch.cat([torch.ones(n, past, dtype=torch.bool), own], dim=1)[None, None].to(dev)
        # An additive float mask (0 where a node attends, the dtype's minimum elsewhere): every attention
        # implementation reads it the same way. A boolean 4-D mask is read as "True = attend" by sdpa but
        # is added to the scores as 0/1 by transformers' eager attention, which then masks nothing.
        dtype = self.target.model.dtype
        mask = torch.zeros(seen.shape, dtype=dtype, device=dev).masked_fill(~seen, torch.finfo(dtype).min)
        pos = (torch.tensor(depth) + past)[None].to(dev)
        start = time.perf_counter()
        out = self.target.model.base_model(
            input_ids=torch.tensor([tokens], device=dev),
            attention_mask=mask,
            position_ids=pos,
            use_cache=True,
            output_hidden_states=True,
            **{self._cache_kw: self.cache},
        )
        self.calls += 1
        res = self.target.outputs(out, with_logits=not last_logits_only)
        last = res.last_hidden[0, -1:]  # [1, H]
        logits = self.target.logits_from_hidden(last) if last_logits_only else res.logits[0]
        if logits.is_cuda:  # the loop reads the logits right away: time the kernels, not the launch
            torch.cuda.synchronize(logits.device)
        self.seconds += time.perf_counter() - start
        return res.features[0], logits

    def probe(self, n: int) -> float:
        """Seconds of one forward over n tokens (a chain) after the cache, which is then restored: the
        auto tree budget's measurement of the forward-time curve (budget.py). Counts no call."""
        committed, calls, seconds = len(self), self.calls, self.seconds
        self.forward([0] * n)
        spent = self.seconds - seconds
        self.keep(committed, [])
        self.calls, self.seconds = calls, seconds
        return spent

    def keep(self, committed: int, kept: list[int]) -> None:
        """After a forward: keep the first `committed` cache entries and, of the entries fed after them,
        those at offsets `kept` (ascending, as a path from the root is). Only plain (non-sliding) dynamic
        layers can be cut. In place: the kept entries not yet in place move down (a few rows), then
        each layer is cut to a view, instead of a copy of the whole cache per layer; nothing else holds
        these tensors (the next forward concatenates onto them)."""
        if any(b <= a for a, b in zip(kept, kept[1:])):
            raise ValueError(f"kept offsets must be ascending, got {kept}")
        length = committed + len(kept)
        moves = [(committed + i, committed + k) for i, k in enumerate(kept) if k != i]
        if not moves and length == len(self):  # a plain step, or every fed node kept: nothing to cut
            return
        dst, src = (torch.tensor(x) for x in zip(*moves)) if moves else (None, None)
        for layer in self.cache.layers:
            if type(layer) is not DynamicLayer:
                raise NotImplementedError(f"cannot gather a {type(layer).__name__} cache (sliding window?)")
            if moves:  # each destination lies below its source: the gather reads before anything is written
                dst, src = dst.to(layer.keys.device), src.to(layer.keys.device)
                layer.keys[..., dst, :] = layer.keys[..., src, :]
                layer.values[..., dst, :] = layer.values[..., src, :]
            layer.keys, layer.values = layer.keys[..., :length, :], layer.values[..., :length, :]
