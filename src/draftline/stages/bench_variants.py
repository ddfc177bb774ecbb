"""Draft variants trained in the run (``train.variants``), benchmarked beside the main draft.

Each variant is served as the main draft is (``{name}-k{n}`` for every ``num_speculative_tokens``,
greedy drafting, the same levels and temperatures), with the speculative config its family asks
for (``bench.speculative_config``). The
comparison takes, per (temperature, concurrency) and per draft, its fastest draft length, and
names the draft with the highest median output tok/s: what to serve at that concurrency.
"""

from __future__ import annotations

import json
from pathlib import Path

from draftline.drafts import registry

MAIN = "eagle3"  # the main draft's configurations are eagle3-k{n}
NEAR_TIE = 1.05  # margins under 5% are within this host's noise (bench.fastest_markdown)


def configurations(names: list[str], num_speculative_tokens: list[int]) -> list[dict]:
    """One benchmark configuration per variant and draft length."""
    return [{"name": f"{name}-k{n}", "num_speculative_tokens": n, "variant": name}
            for name in names for n in num_speculative_tokens]


def family(draft_dir: str | Path) -> str | None:
    """The draft family its exported config.json describes (what the comparison labels)."""
    path = Path(draft_dir) / "config.json"
    return family_of(json.loads(path.read_text())) if path.is_file() else None


def family_of(draft_cfg: dict) -> str:
    """The label of the draft an exported config describes (DFlash, P-EAGLE, EAGLE-3.1 or
    EAGLE-3, with MLA attention or not): its family's (``draftline.drafts.registry``), which
    labels train.draft the same way for the plan."""
    return registry.served_label(draft_cfg)


def _draft_of(config: dict) -> str | None:
    """The trained draft a greedy configuration serves (the main one or a variant)."""
    if config["num_speculative_tokens"] is None or config.get("draft"):
        return None
    if config.get("draft_sample_method", "greedy") != "greedy":
        return None
    return config.get("variant") or MAIN


def comparison(summary: list[dict], configs: list[dict], families: dict[str, str]) -> list[dict]:
    """Per (temperature, concurrency) where a variant was measured: each trained draft at its
    fastest draft length (acceptance length, median tok/s, TPOT p50) and the one to serve,
    with its margin over the next. Empty without variants."""
    drafts = {c["name"]: _draft_of(c) for c in configs if _draft_of(c)}
    lengths = {c["name"]: c["num_speculative_tokens"] for c in configs}
    if set(drafts.values()) == {MAIN} or not drafts:
        return []
    cells: dict[tuple, dict[str, dict]] = {}
    for s in summary:
        draft = drafts.get(s["config"])
        if draft is None:
            continue
        best = cells.setdefault((s["temperature"], s["concurrency"]), {}).get(draft)
        if best is None or s["output_tok_s"]["median"] > best["output_tok_s"]["median"]:
            cells[(s["temperature"], s["concurrency"])][draft] = s
    rows = []
    for (temperature, level), by_draft in sorted(cells.items()):
        ranked = sorted(by_draft, key=lambda d: by_draft[d]["output_tok_s"]["median"],
                        reverse=True)
        first, second = ranked[0], ranked[1] if len(ranked) > 1 else None
        margin = (by_draft[first]["output_tok_s"]["median"]
                  / by_draft[second]["output_tok_s"]["median"]) if second else None
        rows.append({
            "temperature": temperature, "concurrency": level,
            "drafts": {d: {"family": families.get(d), "config": s["config"],
                           "num_speculative_tokens": lengths[s["config"]],
                           "acceptance_length": s["acceptance_length"],
                           "output_tok_s": s["output_tok_s"]["median"],
                           "tpot_ms_p50": (s.get("tpot_ms_p50") or {}).get("median")}
                       for d, s in sorted(by_draft.items())},
            "serve": first, "runner_up": second,
            "margin": round(margin, 4) if margin else None,
            "acceptance_varies_with_c": bool(by_draft[first].get("acceptance_varies_with_c"))})
    return rows


def comparison_markdown(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    names = sorted({d for r in rows for d in r["drafts"]}, key=lambda d: (d != MAIN, d))
    families = {d: r["drafts"][d]["family"] for r in rows for d in r["drafts"]}
    header = " | ".join(f"{d} ({families[d]})" if families.get(d) else d for d in names)
    lines = ["", "## Draft variants trained in this run", "",
             "Each trained draft at its fastest draft length per temperature and concurrency: "
             "acceptance length / median output tok/s / TPOT p50 ms (k). `serve` names the "
             "fastest, with its margin over the next (`~` under 5%: within this host's noise).",
             "", f"| T | C | {header} | serve | margin |",
             "|---|---|" + "---|" * len(names) + "---|---|"]
    for r in rows:
        cells = []
        for d in names:
            cell = r["drafts"].get(d)
            cells.append("-" if cell is None else
                         f"{cell['acceptance_length'] or '-'} / {cell['output_tok_s']:.1f} / "
                         f"{_ms(cell['tpot_ms_p50'])} (k{cell['num_speculative_tokens']})")
        close = " ~" if r["margin"] is not None and r["margin"] < NEAR_TIE else ""
        marked = " (acceptance marked c)" if r["acceptance_varies_with_c"] else ""
        lines.append(f"| {r['temperature']:g} | {r['concurrency']} | {' | '.join(cells)} | "
                     f"{r['serve']}{marked} | {r['margin'] or '-'}{close} |")
    return lines


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"
