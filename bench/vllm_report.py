"""`specserve bench --section vllm`'s results from the measured cells: each ratio against the best vLLM server of
its kind, chosen after the fact within one group (`results`), and the Markdown report (`report_markdown`). Summary
keys: docs/benchmarks.md."""

from __future__ import annotations

import json

MODEL_FREE_PEERS = ("vllm_plain", "vllm_ngram2", "vllm_ngram4", "vllm_ngram8", "vllm_suffix")
DRAFT_PEERS = ("vllm_draft2", "vllm_draft4", "vllm_draft8")


def _best_ratio(best: dict, ours: str, peers) -> tuple[float, str] | None:
    """(min over groups and peers of ours / peer, that peer): specserve against the best of `peers`, each ratio
    within one group; None where no group ran both."""
    ratios = {(group, peer): speeds[ours] / speeds[peer] for group, speeds in best.items() if ours in speeds
              for peer in peers if peer in speeds}
    if not ratios:
        return None
    group, peer = min(ratios, key=ratios.get)
    return ratios[(group, peer)], peer


def results(cells: dict, preset: dict) -> dict:
    """Summary and rows from each group's cells ({group: {(workload, load, label): cell}}); every ratio divides
    two figures of the same group (measured interleaved). A summary key is present where it was measured."""
    rows, summary = [], {}
    for workload in preset["workloads"]:
        for load in preset["loads"]:
            key = f"{workload}@{load}"
            here = {group: {label: cell for (w, c, label), cell in by_cell.items() if w == workload and c == load}
                    for group, by_cell in cells.items()}
            best = {group: {label: max(cell["runs"]) for label, cell in by_label.items()}
                    for group, by_label in here.items()}
            row = {"workload": workload, "load": load, "tokens_per_s": best}
            for name, ours, peers in (("vs_vllm", "specserve_exact", MODEL_FREE_PEERS),
                                      ("vs_vllm_native", "specserve_native_exact", MODEL_FREE_PEERS),
                                      ("vs_vllm_draft", "specserve_draft_exact", DRAFT_PEERS)):
                found = _best_ratio(best, ours, peers)
                if found:
                    summary.setdefault(name, {})[key], row[f"best_{name}"] = found
                    row[name] = found[0]
            if "suffix" in best:
                speeds = best["suffix"]
                ours = speeds.get("specserve_suffix_exact", speeds["specserve_exact"])  # the config's drafter is suffix
                summary.setdefault("vs_vllm_suffix", {})[key] = row["vs_vllm_suffix"] = ours / speeds["vllm_suffix"]
            if "specserve_asd" in best.get("ngram", {}):
                ngram = best["ngram"]
                summary.setdefault("vllm_asd_vs_exact", {})[key] = row["asd_vs_exact"] = (
                    ngram["specserve_asd"] / ngram["specserve_exact"])
            placement = {group: speeds for group, speeds in best.items()
                         if {"specserve_draft_exact", "specserve_actor_exact"} <= set(speeds)}
            if placement:
                group, speeds = next(iter(placement.items()))
                cell = here[group]
                row["drafter_placement"] = summary.setdefault("drafter_placement", {})[key] = {
                    "in_worker_tok_s": speeds["specserve_draft_exact"], "actor_tok_s": speeds["specserve_actor_exact"],
                    "in_worker_vs_actor": speeds["specserve_draft_exact"] / speeds["specserve_actor_exact"],
                    "in_worker_step_s": min(cell["specserve_draft_exact"].get("step_s") or [float("nan")]),
                    "actor_step_s": min(cell["specserve_actor_exact"].get("step_s") or [float("nan")])}
            row["acceptance"] = {group: {label: cell.get("acceptance") for label, cell in by_label.items()}
                                 for group, by_label in here.items()}
            row["greedy_text_agreement"] = _agreement(here)
            row["runs"] = {group: {label: cell["runs"] for label, cell in by_label.items()}
                           for group, by_label in here.items()}
            rows.append(row)
    return {"summary": summary, "rows": rows}


def _agreement(here: dict) -> dict:
    """Per specserve exact server, the share of its texts equal to vLLM plain's (else to its group's first vLLM
    server's, which is named)."""
    plain = next((by_label["vllm_plain"]["texts"] for by_label in here.values() if "vllm_plain" in by_label), None)
    agree = {}
    for group, by_label in here.items():
        reference, name = plain, "vllm_plain"
        if reference is None:
            name = next(label for label in by_label if label.startswith("vllm_"))
            reference = by_label[name]["texts"]
        for label in (label for label in by_label if label.endswith("_exact")):
            texts = by_label[label]["texts"]
            suffix = "" if name == "vllm_plain" else f" vs {name}"
            agree[f"{group}/{label}{suffix}"] = sum(a == b for a, b in zip(reference, texts)) / max(len(texts), 1)
    return agree


COLUMNS = {"specserve_exact": "specserve exact", "specserve_asd": "specserve asd",
           "specserve_native_exact": "specserve native, exact", "specserve_suffix_exact": "specserve suffix, exact",
           "specserve_draft_exact": "specserve draft in worker, exact",
           "specserve_actor_exact": "specserve drafter actor, exact", "vllm_plain": "vLLM plain",
           "vllm_ngram2": "ngram k=2", "vllm_ngram4": "ngram k=4", "vllm_ngram8": "ngram k=8",
           "vllm_suffix": "vLLM suffix", "vllm_draft2": "draft k=2", "vllm_draft4": "draft k=4",
           "vllm_draft8": "draft k=8"}
RATIOS = ("vs_vllm", "vs_vllm_native", "vs_vllm_suffix", "vs_vllm_draft", "asd_vs_exact")


def report_markdown(results: dict) -> str:
    """Tokens/s per group (with acceptance), then the ratios per workload and load."""
    meta, rows = results["meta"], results["rows"]
    lines = ["# specserve vs vLLM's own server", "",
             f"- command: `{meta['command']}`", f"- started {meta['started']}, took {meta['elapsed_s']:.0f} s",
             f"- preset: {json.dumps(meta['preset'])}"]
    if meta.get("min_available_gib") is not None:
        lines.append(f"- lowest available memory during the run: {meta['min_available_gib']:.1f} GiB")
    lines += ["",
              "Output tokens/s, greedy `/v1/completions`, waves of N requests; the fastest repeat of each cell, with "
              "the acceptance of its drafts in parentheses. Servers run in groups (memory); a group's targets are "
              "measured interleaved, and every ratio divides two figures of one group.", ""]
    for group in rows[0]["tokens_per_s"]:
        labels = [c for c in COLUMNS if c in rows[0]["tokens_per_s"][group]]
        lines += [f"## Group `{group}`", "", "| workload | N | " + " | ".join(COLUMNS[c] for c in labels) + " |",
                  "|---|---|" + "---|" * len(labels)]
        for row in rows:
            cells = []
            for label in labels:
                accept = row["acceptance"][group][label]
                cells.append(f"{row['tokens_per_s'][group][label]:.1f}" + (f" ({accept:.0%})" if accept is not None
                                                                           else ""))
            lines.append(f"| {row['workload']} | {row['load']} | " + " | ".join(cells) + " |")
        lines.append("")
    present = [r for r in RATIOS if any(r in row for row in rows)]
    placement = any("drafter_placement" in row for row in rows)
    lines += ["## Ratios", "",
              "`vs_vllm` and `vs_vllm_native` divide by the best vLLM server without a draft model, `vs_vllm_draft` "
              "by vLLM's best draft_model k (named); greedy texts agree: the share of requests whose text equals "
              "vLLM plain's, per specserve exact server.", "",
              "| workload | N | " + " | ".join(present) + (" | draft in worker / actor (s per step) |" if placement
                                                             else " |") + " greedy texts agree |",
              "|---|---|" + "---|" * (len(present) + placement + 1)]
    for row in rows:
        cells = []
        for name in present:
            if name not in row:
                cells.append("–")
                continue
            peer = row.get(f"best_{name}")
            figure = f"{row[name]:.2f}" if name == "asd_vs_exact" else f"**{row[name]:.2f}**"
            cells.append(figure + (f" ({peer})" if peer else ""))
        if placement:
            p = row.get("drafter_placement")
            cells.append(f"{p['in_worker_vs_actor']:.2f} ({p['in_worker_step_s']:.3f} / {p['actor_step_s']:.3f})"
                         if p else "–")
        agree = ", ".join(f"{a:.0%}" for a in row["greedy_text_agreement"].values())
        lines.append(f"| {row['workload']} | {row['load']} | " + " | ".join(cells) + f" | {agree} |")
    return "\n".join(lines) + "\n"
