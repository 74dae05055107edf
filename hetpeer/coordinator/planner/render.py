"""A plan as text for people: stages, lanes, standby, and the predicted cost beside the baselines."""

from __future__ import annotations

from hetpeer.coordinator.planner.codecs import steps_factor
from hetpeer.protocol.plan import Plan


def format_plan(plan: Plan, baselines: dict[str, float | None], random_samples: int) -> str:
    lanes = plan.lanes
    lines = [
        f"plan: {len(plan.stages)} stages x {len(lanes)} lanes"
        + (f", {len(plan.standby)} on standby" if plan.standby else "")
        + (f"; {plan.micro_batches} micro-batches of {plan.micro_batch} per lane per step" if not plan.lane_batches else
           f"; lanes take {'/'.join(map(str, plan.lane_batches))} of the {plan.batch} sequences a step, in "
           f"micro-batches of {plan.micro_batch}"),
        "",
        "stage  layers    sync            devices (one per lane, in lane order)",
    ]
    for stage in plan.stages:
        span = f"{stage.layer_start}-{stage.layer_end - 1}"
        lines.append(f"{stage.index:<6} {span:<9} {stage.sync_words:<15} {' '.join(stage.devices)}")
    hops = [stage for stage in plan.stages if stage.hop_codecs]
    if hops:
        lines += ["", "between stages (activations forward / their gradients back):"]
        lines += [f"  stage {stage.index} -> {stage.index + 1}: {stage.hop_codecs}" for stage in hops]
    if plan.check_lines():
        lines += ["", f"stage checks ({plan.recipe.check:.0%} of micro-batches run again by another member of the stage's group):"]
        lines += [f"  {line}" for line in plan.check_lines()]
    recomputing = [stage for stage in plan.stages if stage.recompute]
    if recomputing:
        lines += ["", "recomputed in the backward pass, to fit memory (one more forward each):"]
        lines += [f"  stage {stage.index}: {stage.recompute} of its {stage.layers} layers" for stage in recomputing]
    lines += ["", f"recipe: {plan.recipe.words}", "", "lanes (stage 0 first):"]
    lines += [f"  lane {i}: {' -> '.join(lane)}" + (f"  ({plan.lane_sequences(i)} sequences)" if plan.lane_batches else "")
              for i, lane in enumerate(lanes)]
    if plan.standby:
        lines += ["", "standby:"] + [f"  {line}" for line in plan.standby_lines(names_shown=len(plan.standby))]
    lines += ["", f"predicted cost ({plan.cost_model} model, seconds per step):"]
    width = max(len(key) for key in plan.cost)
    lines += [f"  {key:<{width}}  {value:10.4f}" for key, value in plan.cost.items()]
    if plan.cost_model == "time":
        lines += ["", f"steps factor {plan.steps_factor:.2f} ({_sync_words(plan)}{_codec_words(plan)}): all-reduce's steps "
                      f"to a loss over this plan's, so {plan.to_loss_s:.4f} s a step of all-reduce's progress (docs/gossip.md, "
                      f"The quality table; docs/compression.md)"]
    lines += ["", "same shape, same cost model:"]
    names = {"blocks": "blocks (devices in file order)", "random": f"random (mean of {random_samples})"}
    total = plan.total_s
    lines.append(f"  {'this plan':<32} {total:10.4f}")
    for key, label in names.items():
        value = baselines.get(key)
        if value is None:
            lines.append(f"  {label:<32} {'does not fit in memory':>10}")
        else:
            ratio = f"   ({value / total:.2f}x this plan)" if total > 0 else ""
            lines.append(f"  {label:<32} {value:10.4f}{ratio}")
    return "\n".join(lines)


def _sync_words(plan: Plan) -> str:
    """How the plan's groups sync, and at what lane batch, in a few words."""
    lanes = len(plan.lanes)
    modes = sorted({stage.sync for stage in plan.stages})
    if modes == ["none"]:
        return "one lane: no group to sync"
    tokens = -(-plan.batch // lanes) * plan.seq_len
    batch = f"{tokens:,} tokens a lane-step" if tokens else f"{-(-plan.batch // lanes)} sequences a lane-step"
    batch += " on average" if plan.lane_batches else ""
    return f"{' and '.join(modes)} in groups of {lanes}, {batch}"


def _codec_words(plan: Plan) -> str:
    """The hops' codecs that cost steps, and their factor, in a few words ("" where none does)."""
    pairs = {stage.codecs(lane) for stage in plan.stages[:-1] for lane in range(len(stage.devices))}
    costly = sorted((pair for pair in pairs if steps_factor(pair) > 1), key=steps_factor)
    if not costly:
        return ""
    return f"; hops in {', '.join('/'.join(pair) for pair in costly)}, x{steps_factor(costly[-1]):.3f}"
