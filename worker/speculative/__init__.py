"""Speculative decoding inside the continuous batch.

A sequence that speculates proposes a few tokens it guesses come next (a drafter:
drafters.py); one batched forward pass verifies every sequence's guesses at once
(verify.py), and each keeps the longest prefix the target model agrees with plus the
model's own next token. A step then yields 1 + accepted tokens for one forward pass of
the whole batch, which pays where decode is bound by reading the weights (a GPU, Apple
Silicon) and the guesses are often right (an agent rewriting a file it was shown).
Draft length adapts per sequence to its acceptance, and a sequence whose guesses do not
pay stops guessing (adaptive.py).
"""
