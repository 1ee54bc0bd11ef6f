"""Speculative decoding with a target, a drafter and a verifier (batch 1).

loop.py           the decoding loop (`SpeculativeDecoder`) and its per-iteration statistics
target.py         the frozen target with a KV cache, fed with tree attention
continuations.py  the law each iteration verifies against while a cross-iteration verifier's
                  continuation is in force
drafting.py       a drafter's inference session: its cache across iterations, draft laws along
                  any prefix, chains and i.i.d. drafts
trees.py          draft trees and their shape (`TreeConfig`)
drafters.py       one evaluation-side spec per drafter (tree builder, default tree, adaptation arms)
budget.py         the machine-sized tree budget and chain length (`auto`)
lookup.py         prompt lookup (no drafter)
temperature.py    temperature and top-p: logits to the law decoding samples from
"""
