"""The engine's one switch between invariant and fast numerics, asked by name.

Under invariant numerics that hold (one device, the start-up probe passed) a token's bits
depend on its own history alone: whatever shares its call, however wide the call, whether
a prefill chunk, a decode step or a verification computed it. Each freedom the engine takes
from that is a method here, with its reason; under fast numerics (or on a mesh, or where
the probe failed) every one is refused, and the engine keeps the rules that hold for any
arithmetic: one prompt per prefill call in one chunk shape, prefill-written pages only in
the trie, every slot a row of every decode call, preempted requests recomputed.
Host code: plain Python.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class NumericsPolicy:
    invariant: bool  # a token's bits depend on its own history alone, here and now

    @classmethod
    def for_engine(cls, numerics: str, on_mesh: bool, probe_ok: bool) -> NumericsPolicy:
        """Invariant only with invariant numerics on one device where the probe passed: on
        a mesh the rows are split over "data" and "model"'s partial products are summed in
        an order XLA picks, which is not claimed."""
        return cls(numerics == "invariant" and not on_mesh and probe_ok)

    def shares_prefill_calls(self) -> bool:
        """Prompts being prefilled share each call (a prompt's bits do not depend on the
        rows beside it); otherwise one prompt per call, so each sees one call shape."""
        return self.invariant

    def widens_prefill_calls(self) -> bool:
        """A prefill call may be wider than the chunk when fewer prompts share it (the
        width changes no bit)."""
        return self.invariant

    def caches_written_pages(self) -> bool:
        """Pages written by decode or verification enter the trie: they hold the bits a
        prefill of the same history writes. Otherwise they differ in the last bits."""
        return self.invariant

    def decodes_live_rows_only(self) -> bool:
        """A decode call runs the live samples alone, in fewer rows than the slots (a row's
        bits do not depend on the call's other rows)."""
        return self.invariant

    def packs_prefill(self) -> bool:
        """A decode call may prefill prompts in its steps (packed steps): what shares a
        step changes no bit of a token."""
        return self.invariant

    def resumes_preempted(self) -> bool:
        """A preempted request resumes by prefilling the answer its cache held: the prefill
        writes the bits decoding wrote."""
        return self.invariant
