"""`hetpeer status` on a terminal: the swarm's figures, a table of its peers and the plan, drawn with rich;
and the same data as JSON. `hetpeer status --credit`: the volunteers' leaderboard and the teams'. Pure: what `ApiClient` read in, a renderable, text or a dict out.
"""

from __future__ import annotations

import io
from typing import Sequence

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from hetpeer import logline
from hetpeer.coordinator.ledger import CreditBoard
from hetpeer.coordinator.view import PeerStatus, Progress, route_lines
from hetpeer.protocol.plan import Plan
from hetpeer.protocol.records import PeerRecord

STATE_STYLES = {"training": "green", "standby": "bright_black", "leaving": "dark_orange", "fetching": "blue",
                "waiting": "blue", "probing": "blue"}


def place(plan: Plan | None, record: PeerRecord) -> str:
    """Where the plan puts a peer: s<stage>/l<lane> [layers), standby, or the layers it holds."""
    if plan is not None:
        if record.device_id in plan.standby:
            return "standby"
        try:
            stage, lane = plan.position(record.device_id)
        except KeyError:
            pass
        else:
            s = plan.stages[stage]
            return f"s{stage}/l{lane} [{s.layer_start},{s.layer_end})"
    return f"[{record.layers[0]},{record.layers[1]})" if record.layers else "-"


def status_view(plan: Plan | None, peers: Sequence[PeerStatus], progress: Progress, plan_time: float | None = None,
                problem: str | None = None) -> Group:
    """The swarm's figures, one row per peer, the plan in short; `problem` (a failed refresh) in red above."""
    loss = f"{progress.loss:.4f}" if progress.loss is not None else "-"
    if progress.val_loss is not None:
        loss += f"  val {progress.val_loss:.4f}"
    noise = f"  noise scale {progress.noise_scale:,.0f} tokens" if progress.noise_scale is not None else ""
    states = ", ".join(f"{n} {state}" for state, n in progress.peers_by_state.items()) or "none"
    head = Text.assemble(
        ("swarm ", "bold"), (progress.swarm, "bold cyan"), f"  coordinator {progress.coordinator_key[:16]}\n",
        f"epoch {progress.epoch}  step {progress.step}  loss {loss}  tokens/s {progress.tokens_per_s:.1f}{noise}\n",
        f"peers {sum(progress.peers_by_state.values())} ({states}), {progress.dropped} records dropped",
    )
    table = Table(box=None, header_style="bold", pad_edge=False)
    for name, right in (("peer", False), ("state", False), ("stage", False), ("step", True), ("loss", True),
                        ("tok/s", True), ("TFLOPS", True), ("achieved", True), ("int8 MB/s", True), ("device", False),
                        ("reachable", False), ("age s", True)):
        table.add_column(name, justify="right" if right else "left", no_wrap=True)
    for p in sorted(peers, key=lambda p: p.record.device_id):
        r = p.record
        table.add_row(
            r.device_id, Text(r.state, style=STATE_STYLES.get(r.state, "")), place(plan, r), str(r.step),
            f"{r.loss:.4f}" if r.loss is not None else "-", f"{r.tokens_per_s:.1f}", f"{r.tflops:.3g}",
            f"{r.achieved_tflops:.3g}" if r.achieved_tflops else "-", codec_rate(r.step_costs.int8_s_per_value),
            Text(r.device_name), Text(r.reach_words()), f"{p.age_s:.0f}",
        )
    parts = ([Text(problem, style="bold red")] if problem else []) + [head, Text(""), table, Text("")]
    routes = route_lines(plan, {p.record.device_id: p.record for p in peers}) if plan is not None else []
    return Group(*parts, _plan_text(plan, plan_time), *(Text(f"  routes: {line}") for line in routes))


def codec_rate(s_per_value: float) -> str:
    """A codec's measured encode plus decode time per value as MB/s of fp32 activation ("-": not measured)."""
    return f"{4e-6 / s_per_value:,.0f}" if s_per_value > 0 else "-"


def _plan_text(plan: Plan | None, plan_time: float | None) -> Text:
    if plan is None:
        return Text("no plan yet")
    published = f", published {logline.at(plan_time)}" if plan_time is not None else ""
    lines = [
        f"plan epoch {plan.epoch} from step {plan.start_step}{published}: {len(plan.stages)} stage(s) x "
        f"{plan.group_size} lane(s), {plan.model} {plan.dtype}, batch {plan.batch} in {plan.micro_batches} "
        f"micro-batches of {plan.micro_batch}, predicted {plan.predicted} ({plan.cost_model})"
    ]
    lines += [f"  stage {s.index} layers [{s.layer_start},{s.layer_end}) {s.sync_words}"
              f"{f', to the next in {s.hop_codecs}' if s.hop_codecs else ''}: {' '.join(s.devices)}" for s in plan.stages]
    lines += [f"  checks: {line}" for line in plan.check_lines()]
    lines += [f"  recipe: {plan.recipe.words}"]
    lines += [f"  lane {i}: {' -> '.join(lane)}" + (f" ({plan.lane_sequences(i)} sequences a step)" if plan.lane_batches else "")
              for i, lane in enumerate(plan.lanes)]
    lines += [f"  standby: {line}" for line in plan.standby_lines()]
    return Text("\n".join(lines))


def render_status(plan: Plan | None, peers: Sequence[PeerStatus], progress: Progress, plan_time: float | None = None,
                  width: int = 200) -> str:
    """`status_view` as plain text, `width` columns wide (for pipes, logs and tests)."""
    console = Console(file=io.StringIO(), width=width, color_system=None, force_terminal=False)
    console.print(status_view(plan, peers, progress, plan_time))
    return console.file.getvalue().rstrip() + "\n"


def status_json(plan: Plan | None, peers: Sequence[PeerStatus], progress: Progress, plan_time: float | None = None) -> dict:
    """What `hetpeer status --json` prints: the progress figures, every peer's record and age, the plan."""
    return {
        "swarm": progress.swarm,
        "coordinator_key": progress.coordinator_key,
        "epoch": progress.epoch,
        "step": progress.step,
        "loss": progress.loss,
        "val_loss": progress.val_loss,
        "tokens_per_s": progress.tokens_per_s,
        "peers_by_state": dict(progress.peers_by_state),
        "dropped": progress.dropped,
        "step_overhead_s": progress.step_overhead_s,
        "noise_scale": progress.noise_scale,
        "peers": [{**p.record.to_wire(), "age_s": p.age_s} for p in sorted(peers, key=lambda p: p.record.device_id)],
        "plan": plan.to_wire() if plan is not None else None,
        "plan_time": plan_time,
    }


CREDIT_SORTS = ("tokens", "flops", "last_hour_tokens", "training_s")  # what the leaderboard can be ranked by
SUSPECT_MARK = "!"


def credit_view(board: CreditBoard, sort: str = "tokens") -> Group:
    """The volunteers ranked by `sort` (most first, ties by device id), suspects marked; the teams ranked the same
    way, where any volunteer has a team. O(volunteers log volunteers)."""
    if sort not in CREDIT_SORTS:
        raise ValueError(f"credit can be ranked by {', '.join(CREDIT_SORTS)}, not {sort!r}")
    if not board.volunteers:
        return Group(Text("no credit yet" + ("" if board.time else ": the coordinator keeps no ledger yet")))
    volunteers = sorted(board.volunteers, key=lambda c: (-getattr(c, sort), c.device_id))
    head = Text(f"credit at {logline.at(board.time)}: {len(volunteers)} volunteer(s), {len(board.teams)} team(s), "
                f"ranked by {sort}")
    table = _credit_table("volunteer", "device", "team", mark=True)
    for rank, c in enumerate(volunteers, 1):
        table.add_row(str(rank), Text(c.name), Text(c.device_id), Text(c.team or "-"), *_credit_figures(c),
                      Text(SUSPECT_MARK, style="bold red") if c.suspect else "")
    parts = [head, Text(""), table]
    if any(c.suspect for c in volunteers):
        parts.append(Text(f"{SUSPECT_MARK}: claimed work its neighbours did not confirm, round after round "
                          "(credited only what they confirm)"))
    if board.teams:
        teams = _credit_table("team", "volunteers")
        for rank, t in enumerate(sorted(board.teams, key=lambda t: (-getattr(t, sort), t.team)), 1):
            teams.add_row(str(rank), Text(t.team), str(t.volunteers), *_credit_figures(t))
        parts += [Text(""), teams]
    return Group(*parts)


def _credit_table(*names: str, mark: bool = False) -> Table:
    table = Table(box=None, header_style="bold", pad_edge=False)
    table.add_column("rank", justify="right", no_wrap=True)
    for name in names:
        table.add_column(name, justify="right" if name == "volunteers" else "left", no_wrap=True)
    for name in ("tokens", "TFLOP", "last hour tokens", "training h", "online h") + (("",) if mark else ()):
        table.add_column(name, justify="right", no_wrap=True)
    return table


def _credit_figures(row) -> tuple[str, ...]:
    return (f"{row.tokens:,}", f"{row.flops / 1e12:.3g}", f"{row.last_hour_tokens:,}", f"{row.training_s / 3600:.2f}",
            f"{row.online_s / 3600:.2f}")


def render_credit(board: CreditBoard, sort: str = "tokens", width: int = 200) -> str:
    """`credit_view` as plain text, `width` columns wide (for pipes, logs and tests)."""
    console = Console(file=io.StringIO(), width=width, color_system=None, force_terminal=False)
    console.print(credit_view(board, sort))
    return "\n".join(line.rstrip() for line in console.file.getvalue().rstrip().splitlines()) + "\n"
