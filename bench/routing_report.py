"""The routing table (Markdown) and the issue-16 targets, from `fleet bench --only routing`."""

from __future__ import annotations

from typing import Any

LABELS = {"one_runner": "(a) one runner", "shared_queue": "(b) 2 runners, shared queue",
          "prefix_routing": "(c) 2 runners, prefix routing", "peer": "(d) mlx_lm.server"}


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def routing_table(info: dict[str, Any]) -> list[str]:
    w = info["plan"]["workload"]
    lines = [
        f"**{info['model']}**: {w['conversations']} conversations x {w['turns']} turns over "
        f"{w['system_prompts']} system prompts of ~{min(info['system_prompt_tokens'])} tokens, "
        f"{w['max_tokens']} new tokens a turn, think time ~{w['think_s']} s; "
        f"{info['plan']['slots']} slots a runner",
        "",
        "| setup | TTFT p50 ms | TTFT p99 ms | cached fraction | prefilled tokens | aggregate "
        "tok/s | model CPU s (ms/token) | mean prompt tokens | turns (errors) | turns per "
        "runner | load before/after |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in info["scenarios"].items():
        spread = "/".join(str(n) for n in sorted(s["runners"].values(), reverse=True)) or "-"
        load = "/".join(f"{s[k][0]:.1f}" if s.get(k) else "-"
                        for k in ("load_before", "load_after"))
        lines.append(
            f"| {LABELS.get(name, name)} | {_ms(s['ttft_p50_s'])} | {_ms(s['ttft_p99_s'])} | "
            f"{_num(s['cached_fraction'], 2)} | {_num(s.get('prefilled_tokens'), 0)} | "
            f"{_num(s['aggregate_tok_s'])} | {_num(s.get('model_cpu_s'))} "
            f"({_num(s.get('model_cpu_ms_per_token'), 0)}) | "
            f"{_num(s['prompt_tokens_mean'], 0)} | {s['turns']} ({len(s['errors'])}) | {spread} "
            f"| {load} |"
        )
    if floor := info.get("arrival_floor_s"):
        span = info["scenarios"].get("one_runner", {}).get("span_s")
        ceiling = f"; so (c) can reach at most {span / floor:.2f}x (a)" if span else ""
        lines += ["", f"the workload's arrivals alone take {floor:.1f} s (its latest "
                  f"conversation's start and think times): no setup finishes sooner{ceiling}"]
    cost = info["routing_cost"]
    lines += ["", f"routing cost per task (hash blocks + choose + record): p50 "
              f"{cost['p50_ms']:.3f} ms, p99 {cost['p99_ms']:.3f} ms over {cost['tasks']} tasks"]
    if (hand_off := info.get("hand_off_cost")) and "error" in hand_off:
        lines.append(f"a hand-off to another node: not measured ({hand_off['error']})")
    elif hand_off:
        lines.append(f"a hand-off to another node (request + answer, {hand_off['bytes']} bytes, "
                     f"loopback): p50 {hand_off['p50_ms']:.3f} ms, p99 "
                     f"{hand_off['p99_ms']:.3f} ms over {hand_off['requests']}")
    return lines


def routing_targets(info: dict[str, Any]) -> list[str]:
    s = info["scenarios"]
    c = s.get("prefix_routing", {})
    checks = [
        ("(c) TTFT p50 <= 0.5x (b)", _ratio(c.get("ttft_p50_s"),
                                              s.get("shared_queue", {}).get("ttft_p50_s")), 0.5,
         "<="),
        ("(c) TTFT p50 <= 0.5x peer", _ratio(c.get("ttft_p50_s"),
                                               s.get("peer", {}).get("ttft_p50_s")), 0.5, "<="),
        ("(c) cached fraction >= 0.8", c.get("cached_fraction"), 0.8, ">="),
        ("(c) aggregate >= 1.7x (a)", _ratio(c.get("aggregate_tok_s"),
                                               s.get("one_runner", {}).get("aggregate_tok_s")),
         1.7, ">="),
        ("routing cost p50 <= 2 ms", info["routing_cost"]["p50_ms"], 2.0, "<="),
    ]
    lines = ["| target | measured | met |", "|---|---|---|"]
    for label, value, bound, op in checks:
        met = "-" if value is None else ("yes" if (value <= bound if op == "<=" else
                                                    value >= bound) else "no")
        lines.append(f"| {label} | {_num(value, 3)} | {met} |")
    return lines


def print_routing(routing: dict[str, Any]) -> None:
    for info in routing.values():
        print(f"### routing: {info['model']}\n")
        print("\n".join(routing_table(info)) + "\n")
        print("\n".join(routing_targets(info)) + "\n")
