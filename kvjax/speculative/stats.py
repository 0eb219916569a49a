"""One statistics type for speculative decoding: the host Drafter path, the device loop,
one request and the engine count the same things the same way. Host code."""

from __future__ import annotations

import dataclasses

import numpy as np

# The per-row counters the device loop returns (besides the by-position arrays).
ROW_KEYS = ("verifications", "drafted", "accepted", "emitted", "alpha_sum", "alpha_count")


@dataclasses.dataclass
class SpecStats:
    target_calls: int = 0
    verifications: int = 0  # sequences verified (a batched call verifies several)
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    accepted_by_position: list[int] = dataclasses.field(default_factory=list)
    drafted_by_position: list[int] = dataclasses.field(default_factory=list)
    verify_s: float = 0.0
    draft_s: float = 0.0
    alpha_sum: float = 0.0  # sum of E[min(p, q)] over tested positions (greedy: p one-hot)
    alpha_count: int = 0  # drafted positions whose whole prefix was accepted
    gamma_history: list[int] = dataclasses.field(default_factory=list)  # γ of each round

    @classmethod
    def empty(cls, gamma: int) -> SpecStats:
        return cls(accepted_by_position=[0] * gamma, drafted_by_position=[0] * gamma)

    def record(self, drafted: int, accepted: int, alpha_terms) -> None:
        """One verified sequence: `drafted` tokens of which the first `accepted` were
        kept; `alpha_terms[i]` is E[min(p, q)] at drafted position i."""
        self.verifications += 1
        self.drafted += drafted
        self.accepted += accepted
        self.emitted += accepted + 1
        for pos in range(drafted):
            self.drafted_by_position[pos] += 1
            self.accepted_by_position[pos] += pos < accepted
            if pos <= accepted:
                self.alpha_sum += float(alpha_terms[pos])
                self.alpha_count += 1

    def add_row(self, out, row: int) -> None:
        """Adds row `row` of a device loop's per-row statistics (numpy; a
        `kvjax.speculative.loop.RowStats`, or anything with its fields)."""
        for key in ROW_KEYS:
            setattr(self, key, getattr(self, key) + getattr(out, key)[row].item())
        for key in ("drafted_by_position", "accepted_by_position"):
            counts = getattr(self, key)
            for i, x in enumerate(np.asarray(getattr(out, key)[row]).tolist()):
                counts[i] += x

    def merge(self, other: SpecStats) -> None:
        """Adds another's counters and timings (its γ history is not this one's)."""
        for f in dataclasses.fields(self):
            if f.name == "gamma_history":
                continue
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if isinstance(mine, list):
                for i, x in enumerate(theirs):
                    mine[i] += x
            else:
                setattr(self, f.name, mine + theirs)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def alpha(self) -> float:
        """α estimated as the mean of E[min(p, q)] over drafted positions that were tested
        on the accepted history (every drafted position up to the first rejection)."""
        return self.alpha_sum / self.alpha_count if self.alpha_count else 0.0

    @property
    def cost_ratio(self) -> float:
        """c: measured draft time per drafted token / target time per verification call."""
        if not self.drafted or not self.target_calls or self.verify_s <= 0:
            return 0.0
        return (self.draft_s / self.drafted) / (self.verify_s / self.target_calls)

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per sequence per verification (accepted drafts + the target's own
        token): what one target call yields for one sequence."""
        return self.emitted / self.verifications if self.verifications else 0.0

    @property
    def wasted(self) -> int:
        """Drafted tokens the target scored and rejected."""
        return self.drafted - self.accepted

    def as_dict(self, timings: bool = True) -> dict:
        """The counters and the derived figures; `timings=False` leaves out the measured
        times and the cost ratio made of them (the device loop cannot time its parts)."""
        out = {**dataclasses.asdict(self), "acceptance_rate": self.acceptance_rate,
               "alpha": self.alpha, "cost_ratio": self.cost_ratio,
               "mean_accepted_length": self.mean_accepted_length, "wasted": self.wasted}
        if not timings:
            for key in ("verify_s", "draft_s", "cost_ratio"):
                del out[key]
        return out
