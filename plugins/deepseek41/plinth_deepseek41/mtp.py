"""The ``mtp`` drafter: DeepSeek V4's next-token-prediction block, shipped inside the target file.

How it drafts (catch up on committed rows, then chain its own output rows) is
:class:`plinth.speculative.draft_head.HeadDrafter`'s: the MTP block reads the target's streams
h_p (tap n_layer) and the token t_{p+1}, and when chaining its own output streams stand in for
the target's h (as the DeepSeek V3/V4 MTP runs chained). The draft head "mtp" of
``target.target_view()`` (:class:`plinth_deepseek41.deepseek4.MtpHead`) runs the file's MTP block
``depth`` with the target's shared embedding and head. Deterministic (greedy); losslessness
comes from verification, as for every drafter.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from plinth.errors import UserError
from plinth.graph import Batch
from plinth.speculative.base import BaseDrafter
from plinth.speculative.draft_head import HeadDrafter


class MtpDrafter(HeadDrafter):
    name = "mtp"

    def __init__(self, target: Any, n_draft: int = 4, depth: int = 0, head_model: Any = None) -> None:
        """head_model: llama.cpp's separate MTP head file of this target, loaded (``--draft FILE``); default:
        the MTP block inside the target's own file."""
        if head_model is None:
            super().__init__(target, n_draft)
        else:
            self._attach(target, head_model, n_draft)
        if self.head.n_blocks <= depth:
            raise UserError(f"drafter 'mtp': MTP block {depth} asked for, the file has {self.head.n_blocks}")
        self.depth = depth

    def _attach(self, target: Any, head_model: Any, n_draft: int) -> None:
        """Drive the head of llama.cpp's head-only MTP file with the target's streams (its n_layer tap)."""
        import numpy as np

        hp, thp = head_model.hparams, target.hparams
        if not getattr(hp, "mtp_only", False):
            raise UserError(f"drafter 'mtp': {head_model.path} is not an MTP head file (llama.cpp's convert --mtp)")
        same = ("n_embd", "n_vocab", "hc", "n_layer", "n_head", "head_dim", "n_expert")
        bad = [f"{k} {getattr(hp, k)} != {getattr(thp, k, None)}" for k in same if getattr(hp, k) != getattr(thp, k, None)]
        shared = [n for n in ("token_embd.weight", "output.weight", "output_norm.weight")
                  if not np.array_equal(head_model.graph.backend.to_numpy(head_model.weights[n]),
                                        target.graph.backend.to_numpy(target.weights[n]))]
        if bad or shared:
            raise UserError(f"drafter 'mtp': {head_model.path} is not {target.path}'s MTP head ("
                            + ", ".join(bad + [f"{n} differs" for n in shared]) + ")")
        BaseDrafter.__init__(self)
        self.head = head_model.target_view().draft_head("mtp")
        self.n_draft = n_draft
        self.tap = self.head.taps[0]
        self._rows, self._cache, self._done = {}, {}, {}

    def missing_head(self, target: Any, view: Any) -> str:
        return (f"drafter 'mtp': {target.path} ({target.arch}) ships no MTP block (draft heads: "
                f"{view.draft_heads or 'none'}); use another drafter")

    def run(self, seq: int, tokens: Sequence[int], hidden: Any, start: int) -> Any:
        batch = Batch.from_tokens(list(tokens), start=start, seq=seq, output="all")
        return self.head.run(batch, hidden, self._cache[seq], self.depth)


def make_mtp_drafter(target: Any, options: Mapping[str, Any]) -> MtpDrafter:
    head = None
    if options.get("draft"):  # llama.cpp's separate MTP head file (--draft FILE)
        from plinth import load_model

        head = load_model(options["draft"])
    return MtpDrafter(target, n_draft=int(options.get("n_max", 4)), depth=int(options.get("mtp_depth", 0)),
                      head_model=head)


__all__ = ["MtpDrafter", "make_mtp_drafter"]
