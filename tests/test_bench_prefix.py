"""The ideal cache the multi-turn benchmark measures reuse against (`ideal_reused`)."""

from __future__ import annotations

from kvjax.bench.prefix import ideal_reused


def test_ideal_reuse_counts_every_full_page_computed_before():
    system = list(range(10))  # 2 full pages of 4, and 2 tokens
    a1, b1 = system + [50, 51], system + [60]
    calls = [[(a1, [70, 71, 72, 73, 74]), (b1, [80, 81])],
             [(a1 + [70, 71, 72, 73, 74] + [90], [1, 2])]]
    # call 1: a1 is cold; b1 shares 2 full pages with a1's prompt (same call).
    # call 2: a1's prompt + answer minus its last token (16 tokens) are 4 full pages; the
    # prompt has 18 tokens, so its last token's page (page 4) is computed: 4 pages reused.
    assert ideal_reused(calls, 4) == 0 + 8 + 16
    assert ideal_reused([[(list(range(8)), [9])], [(list(range(8)), [9])]], 4) == 4
