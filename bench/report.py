"""The table on stdout (Markdown, so bench/README.md can hold it as printed)."""

from __future__ import annotations

from typing import Any

PATH_NAMES = ("limit", "peer", "fleet_http", "fleet_nats")
RATIO_COLUMNS = (("fleet_http", "limit"), ("fleet_nats", "limit"),
                 ("fleet_http", "peer"), ("fleet_nats", "peer"))


def _fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "ms":
        return f"{value * 1000:.1f}"
    if unit == "x":
        return f"{value:.2f}x"
    return f"{value:.1f}"


def _rows(scenario: str) -> list[tuple[str, str, str]]:
    """(label, metric key, unit) for one scenario."""
    if scenario == "c1":
        return [(f"{scenario} TTFT p50 ms", "ttft_p50_s", "ms"),
                (f"{scenario} TTFT p95 ms", "ttft_p95_s", "ms"),
                (f"{scenario} decode tok/s", "decode_tok_s", "")]
    return [(f"{scenario} aggregate tok/s", "aggregate_tok_s", ""),
            (f"{scenario} TTFT p50 ms", "ttft_p50_s", "ms"),
            (f"{scenario} per-stream tok/s", "decode_tok_s", "")]


def text_table(model: str, mode: str, scenarios: dict[str, dict[str, Any]]) -> list[str]:
    paths = [p for p in PATH_NAMES if any(p in row for row in scenarios.values())]
    ratios = [(a, b) for a, b in RATIO_COLUMNS if a in paths and b in paths]
    any_row = next(iter(scenarios.values()))
    prompt = next((c.get("prompt_tokens") for c in any_row.values() if c.get("prompt_tokens")),
                  None)
    lines = [f"**{model}**, prompts `{mode}` (~{prompt or '?'} prompt tokens)", ""]
    header = ["metric", *paths, *(f"{a.split('_')[1]}/{b}" for a, b in ratios)]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|")
    for scenario, row in scenarios.items():
        for label, key, unit in _rows(scenario):
            cells = [_fmt(row.get(p, {}).get(key), unit) for p in paths]
            for a, b in ratios:
                cells.append(_fmt(row[a].get(f"vs_{b}", {}).get(key), "x"))
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    problems = [f"{p} {scenario}: {c['errors']} errors ({c['first_error']}), "
                f"{c['short_streams']} short" for scenario, row in scenarios.items()
                for p, c in row.items() if c["errors"] or c["short_streams"]]
    if problems:
        lines += ["", "problems: " + "; ".join(problems)]
    return lines


FLEET_PATHS = ("fleet_http", "fleet_nats")


def stream_failures(text: dict[str, Any]) -> list[str]:
    """Every cell with a failed stream, on any path: a run with one is no measurement, so
    `fleet bench` exits non-zero (streams that ended short are flagged in the table only)."""
    return [
        f"{model} {mode} {scenario} {path}: {cell['errors']} of {cell['streams']} streams "
        f"failed ({cell['first_error']})"
        for model, info in text.items()
        for mode, scenarios in info.get("results", {}).items()
        for scenario, row in scenarios.items()
        for path, cell in row.items() if cell["errors"]
    ]


def _get(results: dict[str, Any], mode: str, scenario: str, path: str, key: str) -> Any:
    return results.get(mode, {}).get(scenario, {}).get(path, {}).get(key)


# Issue 23: "smollm2-135m, 8 concurrent clients, defaults": Fleet against mlx_lm.server, as
# one burst of 8 and as 8 closed-loop clients (the bench's `--slots 0`, the default, is
# Fleet's default batch width).
ISSUE_23 = (("aggregate_tok_s", ">= 1.0", 1.0, True), ("ttft_p50_s", "<= 1.0", 1.0, False))


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target of issues 7 and 23, per model and Fleet path: the value and whether met."""
    rows: list[dict[str, Any]] = []

    def add(model: str, target: str, path: str, value: float | None, limit: float,
            at_least: bool) -> None:
        met = None if value is None else (value >= limit if at_least else value <= limit)
        rows.append({"model": model, "target": target, "path": path, "value": value,
                     "threshold": limit, "met": met})

    for model, info in result["text"].items():
        res = info["results"]
        for path in FLEET_PATHS:
            vs = (_get(res, "unique", "c1", path, "vs_limit") or {})
            add(model, "c1 decode tok/s / limit >= 0.98 (unique)", path,
                vs.get("decode_tok_s"), 0.98, True)
            add(model, "c1 TTFT p50 added vs limit <= 5 ms (unique)", path,
                _get(res, "unique", "c1", path, "ttft_added_ms_vs_limit"), 5.0, False)
            for mode in ("unique", "shared"):
                vs8 = _get(res, mode, "burst8", path, "vs_limit") or {}
                add(model, f"burst8 aggregate / limit >= 0.98 ({mode})", path,
                    vs8.get("aggregate_tok_s"), 0.98, True)
                for width in (4, 8):
                    peer = _get(res, mode, f"burst{width}", path, "vs_peer") or {}
                    add(model, f"burst{width} TTFT p50 / peer <= 0.5 ({mode})", path,
                        peer.get("ttft_p50_s"), 0.5, False)
            for scenario in ("c1", "burst4", "burst8"):
                peer = _get(res, "shared", scenario, path, "vs_peer") or {}
                add(model, f"shared-prompt {scenario} TTFT p50 / peer <= 1.0", path,
                    peer.get("ttft_p50_s"), 1.0, False)
            for scenario in ("burst8", "clients8"):
                for mode in ("unique", "shared"):
                    peer = _get(res, mode, scenario, path, "vs_peer") or {}
                    for key, bound, limit, at_least in ISSUE_23:
                        name = "aggregate" if key == "aggregate_tok_s" else "TTFT p50"
                        add(model, f"issue 23: {scenario} {name} / peer {bound} ({mode})", path,
                            peer.get(key), limit, at_least)
    return rows


def targets_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| model | target | path | value | met |", "|---|---|---|---:|---|"]
    for row in rows:
        if row["value"] is None:
            continue
        value = "-" if row["value"] is None else f"{row['value']:.2f}"
        met = {True: "yes", False: "**no**", None: "-"}[row["met"]]
        lines.append(f"| {row['model']} | {row['target']} | {row['path']} | {value} | {met} |")
    return lines


def plumbing_table(plumbing: dict[str, Any]) -> list[str]:
    lines = ["| plumbing | value |", "|---|---:|"]
    for key, value in _flatten(plumbing):
        shown = f"{value:.3f}" if isinstance(value, float) else str(value)
        lines.append(f"| {key} | {shown} |")
    return lines


def _flatten(data: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    flat: list[tuple[str, Any]] = []
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat += _flatten(value, f"{name}.")
        elif not isinstance(value, list):
            flat.append((name, value))
    return flat


def print_report(result: dict[str, Any]) -> None:
    machine = result["machine"]
    print(f"\n## fleet bench ({result['mode']}) {result['started']}\n")
    print(f"{machine['cpu']}, {machine['cores']} cores, {machine['blas']}, "
          f"OPENBLAS_NUM_THREADS={machine['openblas_num_threads']}, load "
          f"{machine['load_average_start']} -> {machine.get('load_average_end')}")
    if wait := result.get("load_wait"):
        print(f"waited {wait['waited_s']} s for a 1-minute load below {wait['limit']} "
              f"(load {wait['load_before']} -> {wait['load_after']})")
    print(f"plan: {result['plan']}; {result.get('elapsed_s', '?')} s in all\n")
    for model, info in result["text"].items():
        startups = ", ".join(f"{k} {info[k]['startup_s']:.1f}s" for k in ("limit", "peer", "fleet")
                             if k in info and info[k].get("startup_s") is not None)
        fleet = info.get("fleet", {})
        print(f"### {model}\n\nstartup: {startups}; peer OpenBLAS mapped: "
              f"{info.get('peer', {}).get('openblas_mapped', '-')}; Fleet slots "
              f"{fleet.get('slots', '-')} (the runner took {fleet.get('runner_slots', '-')})\n")
        for mode, scenarios in info["results"].items():
            print("\n".join(text_table(model, mode, scenarios)) + "\n")
    if result.get("targets"):
        print("### targets (issues 7 and 23)\n")
        print("\n".join(targets_table(result["targets"])) + "\n")
    if result.get("plumbing"):
        print("### plumbing\n")
        print("\n".join(plumbing_table(result["plumbing"])))
    for note in result.get("notes", []):
        print(f"\nnote: {note}")


if __name__ == "__main__":
    import json
    import sys
    from pathlib import Path

    # Reprint a run's tables from its JSON: python -m bench.report bench/results/<file>.json
    print_report(json.loads(Path(sys.argv[1]).read_text()))
