"""A draft proposer for tests: each sample's true continuation, with random mistakes."""
from __future__ import annotations

import random


class OracleProposer:
    """Proposes each sample's continuation from a run without drafts (``outputs``, keyed
    by prompt and sample index), every draft wrong (the next token id, almost always one
    a grammar bans) with probability 0.3, so accept lengths are random."""

    def __init__(self, outputs, seed: int):
        self.truth = {(tuple(o.prompt_token_ids), c.index): c.token_ids
                      for o in outputs for c in o.outputs}
        self.rng = random.Random(seed)

    def propose(self, requests, num_drafts):
        out = []
        for request, k in zip(requests, num_drafts):
            truth = self.truth[(tuple(request.prompt_token_ids), request.index)]
            done = request.num_output_tokens
            out.append([t if self.rng.random() > 0.3 else (t + 1) % 49152
                        for t in truth[done:done + k]])
        return out

    def forget(self, req_id):
        pass
