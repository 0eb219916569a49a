"""The printed digest of a `scripts/device_check` report (`kvjax.bench.device_check`)."""

from __future__ import annotations

from kvjax.lab.report import markdown_table

DECODE_COLUMNS = [
    ("batch", lambda r: str(r["batch"])),
    ("backend", lambda r: r["backend"]),
    ("ms/step", lambda r: f"{r['ms_per_step']:.2f}"),
    ("tokens/s", lambda r: f"{r['tokens_per_s']:,.0f}"),
    ("GB/s", lambda r: f"{r['hbm_bytes_per_s'] / 1e9:,.0f}"),
    ("of peak", lambda r: "-" if r["fraction_of_peak"] is None
     else f"{r['fraction_of_peak']:.0%}"),
    ("kernel speedup", lambda r: r["speedup"]),
]


def summary(report: dict) -> str:
    """The printed digest of a report."""
    lines = []
    k = report["kernel_check"]
    if k.get("skipped"):
        lines.append(f"kernel: skipped ({k['skipped']})")
    else:
        for c in k["cases"]:
            verdict = "PASS" if c["passed"] else "FAIL"
            lines.append(f"kernel {k['backend']} {c['q_dtype']} q / {c['cache_dtype']} cache, "
                         f"{c['precision']} precision: max abs error {c['max_abs_error']:.2e} "
                         f"(tol {c['tol']:g}) {verdict if c['gates'] else verdict.lower()}"
                         f"{'' if c['gates'] else ' (reported, not gated)'}; vs exact: kernel "
                         f"{c['kernel_vs_exact']:.1e}, reference {c['reference_vs_exact']:.1e}")
        t = k["timing"]
        lines.append(f"kernel alone: {t['kernel_ms']:.3f} ms vs reference {t['reference_ms']:.3f}"
                     f" ms ({t['kernel_speedup']:.2f}x), {t['rows']} rows")
    p = report["prefix_ttft"]
    lines.append(f"TTFT, {p['prefix_tokens']}-token cached prefix + {p['suffix_tokens']}: warm "
                 f"{p['warm_ttft_s'] * 1e3:.1f} ms vs cold {p['cold_ttft_s'] * 1e3:.1f} ms "
                 f"({p['speedup']:.1f}x; {p['warm_reused_tokens']} tokens reused)")
    rows = []
    for point in report["decode"]["points"]:
        for name in ("reference", "kernel"):
            if name in point:
                speedup = f"{point['kernel_speedup']:.2f}x" if name == "kernel" else ""
                rows.append(point[name] | {"batch": point["batch"], "speedup": speedup})
    lines.append("\n" + markdown_table(rows, DECODE_COLUMNS))
    if report["decode"]["note"]:
        lines.append(report["decode"]["note"])
    return "\n".join(lines)
