"""Test helpers for DSpark speculative decoding (not a test module).

`OracleDrafter` stands in for `DSpark.forward` (same signature) and proposes the KNOWN greedy continuation with one
deliberate error per round at a scheduled index, so that a verify round accepts exactly the scheduled number of
drafts. Random-weight drafts almost never agree with the target, so without it only acceptance length 1 would be
exercised.
"""

import torch


class OracleDrafter:
    """Drafts `reference[start+1 : start+1+K]` with the draft at index `schedule[round]` replaced by another token.

    Args:
        reference: int64 [B, L] the full greedy sequence (prompt + plain greedy tokens) of every sequence.
        block: K drafts per round. schedule: accepted drafts wanted per round (0..K; K = no error), cycled.
        vocab: vocabulary size (the wrong token is (right + 1) mod vocab).
    After a run, `expected` holds the acceptance length (accepted + 1) the schedule implies for each round.
    """

    def __init__(self, reference: torch.Tensor, block: int, schedule, vocab: int):
        self.ref, self.k, self.schedule, self.vocab = reference, block, list(schedule), vocab
        self.calls = 0
        self.expected = []

    def truth(self, start: torch.Tensor) -> torch.Tensor:
        """The reference tokens at positions start+1 .. start+K, [B, K] (0 past the end of the reference)."""
        idx = start[:, None].cpu() + 1 + torch.arange(self.k)
        ref = torch.nn.functional.pad(self.ref, (0, max(0, int(idx.max()) + 1 - self.ref.shape[1])))
        return ref.gather(1, idx)

    def __call__(self, features, feature_positions, feature_valid, last_token, start, embed_weight, head_weight):
        b = last_token.shape[0]
        drafts = self.truth(start)
        good = self.schedule[self.calls % len(self.schedule)]
        self.calls += 1
        if good < self.k:
            drafts[:, good] = (drafts[:, good] + 1) % self.vocab
        self.expected.append(good + 1)
        return drafts.to(last_token.device), torch.zeros(b, self.k, device=last_token.device)
