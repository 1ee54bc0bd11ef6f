"""The frozen target with a KV cache, fed with tree attention (batch 1): the decoding loop's target side.

One forward feeds the root and every draft node after the committed cache (a 4-D mask: each node sees
the cache and its ancestors; position ids = cache length + depth) and returns the target's features and
logits at every node; `keep` then keeps the committed entries, the root and the accepted nodes (prefix
reuse, nothing recomputed).
"""

from __future__ import annotations

import inspect
import time

import torch
from torch import Tensor
from transformers.cache_utils import DynamicCache, DynamicLayer

from specblock.data.target import FeatureTarget


class TargetSession:
    """A frozen causal LM with a DynamicCache, fed with tree attention (batch 1)."""

    def __init__(self, target: FeatureTarget):
        self.target = target
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
