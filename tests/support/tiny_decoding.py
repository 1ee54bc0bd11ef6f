"""Tiny targets and drafters for the decoding-loop tests (`import tiny_decoding`; tests/evaluate): a
peaked random Llama as a FeatureTarget, untrained SpecBlock and EAGLE-3 drafters on it, and the target's
exact law of the next few tokens by enumeration, and the exact law of the real loop's generations."""

from __future__ import annotations

import torch

from specblock.data.target import FeatureTarget
from specblock.evaluate.decoding.loop import DecodeConfig, SpeculativeDecoder
from specblock.evaluate.decoding.temperature import next_token_law
from specblock.evaluate.verify.exact import enumerate_outcomes
from specblock.train.drafters import build_drafter
from specblock.train.modeling.eagle3 import Eagle3Config
from specblock.train.modeling.specblock import SpecBlockConfig

from tiny_models import tiny_llama

VOCAB, HORIZON = 24, 3  # the statistical tests' vocabulary and number of new tokens
PROMPT = [1, 5, 9, 3]
REPEATS = [3, 3, 4, 3, 3, 4, 3]  # a prompt with repeated spans, so lookup finds drafts from the start


def tiny_target(vocab: int, sharpen: float, seed: int = 0) -> FeatureTarget:
    """A random 4-layer Llama whose head is scaled by `sharpen`: a peaked target, a few likely
    continuations, so few samples test its law."""
    model = tiny_llama(vocab, seed=seed, max_position_embeddings=256, tie_word_embeddings=False)
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpen)
    return FeatureTarget(model)


def drafters(target: FeatureTarget, seed: int = 1) -> dict[str, torch.nn.Module]:
    """Untrained SpecBlock (K = 3) and EAGLE-3 (3 steps) drafters on the target, heads scaled by 0.7."""
    torch.manual_seed(seed)
    m = target.model
    emb, head = m.get_input_embeddings().weight, m.get_output_embeddings().weight
    sb = SpecBlockConfig(block_size=3, num_layers=2, rank_hidden=16)
    return {
        "specblock": build_drafter("specblock", sb, m.config, emb, head * 0.7).eval(),
        "eagle3": build_drafter("eagle3", Eagle3Config(ttt_length=3), m.config, emb, head * 0.7).eval(),
    }


def exact_law(
    target: FeatureTarget, temperature: float, top_p: float, prompt=PROMPT, horizon: int = HORIZON
) -> dict[tuple, float]:
    """The target's law of the first `horizon` new tokens after `prompt`, by enumeration."""
    law = {(): 1.0}
    for _ in range(horizon):
        seqs = list(law)
        ids = torch.tensor([prompt + list(s) for s in seqs])
        with torch.no_grad():
            logits = target.model(ids).logits[:, -1].float()
        probs = next_token_law(logits, temperature, top_p).double()
        law = {
            s + (t,): law[s] * float(probs[i, t]) for i, s in enumerate(seqs) for t in range(probs.shape[1])
        }
    return law


def loop_law(target, drafter, cfg: DecodeConfig, carry: bool = True, prompt=PROMPT, accepted=None):
    """The exact law of the loop's generated sequences: every random choice of the real decoding loop
    (drafts, verifier coins, corrections, bonus tokens) enumerated with the exact sampler. `accepted`, a
    list, receives the probability of the outcomes in which some draft token was accepted."""
    dec = SpeculativeDecoder(target, drafter, cfg)
    dec.cross = dec.cross and carry
    law: dict[tuple, float] = {}
    hits = []

    def run(s):
        g = dec.generate(prompt, sampler=s)
        hits.append(any(it.accepted for it in g.iterations))
        return tuple(g.tokens)

    for i, (w, seq) in enumerate(enumerate_outcomes(run)):
        law[seq] = law.get(seq, 0.0) + w
        if accepted is not None and hits[i]:
            accepted.append(w)
    return law


def max_error(a: dict, b: dict) -> float:
    return max(abs(a.get(x, 0.0) - b.get(x, 0.0)) for x in set(a) | set(b))


class OracleRoot:
    """Patches the drafter's logits after any prefix with `fn(generated tokens + prefix)` (the real drafter
    still runs, caches and all; only its output law is replaced): a test's way to choose the draft law."""

    def __init__(self, fn, prompt_len: int):
        from specblock.evaluate.decoding import drafting

        self.drafting, self.saved = drafting, [(drafting.Root, "logits", drafting.Root.logits)]
        original = drafting.Root.logits

        def logits(root, prefixes):
            out = original(root, prefixes).clone()
            for i, y in enumerate(prefixes):
                out[i] = fn(root._generated + tuple(y), out[i])
            return out

        drafting.Root.logits = logits
        # the patched law depends on the whole prefix, also within a SpecBlock block: memoise per prefix
        self.saved.append((drafting.Root, "law_key", drafting.Root.law_key))
        drafting.Root.law_key = lambda root, prefix: prefix
        adv = drafting.DrafterSession.advance
        self.saved.append((drafting.DrafterSession, "advance", adv))

        def advance(sess, features, tokens, position):
            root = adv(sess, features, tokens, position)
            hist = sess.__dict__.setdefault("_hist", [])
            del hist[position:]
            hist += tokens.tolist()  # hist[j] = the token at absolute index j + 1
            root._generated = tuple(hist[prompt_len - 1 :])
            return root

        drafting.DrafterSession.advance = advance

    @classmethod
    def install(cls, target, prompt, ref):
        """Draft argmax = the target's greedy token after every prefix of `ref`."""
        table = {tuple(ref[:n]): ref[n] for n in range(len(ref))}

        def fn(g, row):
            if g in table:
                row = torch.full_like(row, -10.0)
                row[table[g]] = 10.0
            return row

        return cls(fn, len(prompt))

    def uninstall(self):
        for owner, name, fn in self.saved:
            setattr(owner, name, fn)


def near_target_law(target: FeatureTarget, ids: list[int] | None = None, prompt=PROMPT):
    """For `OracleRoot`: draft logits near the target's after every prefix g of generated tokens (its
    logits at the draft vocabulary `ids`, None = all, plus fixed noise of their spread), so that blocks are
    often accepted in part."""
    cache = {}

    def near(g, row):
        if g not in cache:
            with torch.no_grad():
                lg = target.model(torch.tensor([prompt + list(g)])).logits[0, -1].float()
            lg = lg if ids is None else lg[ids]
            noise = torch.randn(lg.shape, generator=torch.Generator().manual_seed(len(g) * 1000 + sum(g)))
            cache[g] = lg + noise * lg.std()
        return cache[g]

    return near
