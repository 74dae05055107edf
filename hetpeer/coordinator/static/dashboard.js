// The organizer's page: reads a dashboard document (served at api/state, or inlined in a run report) and
// draws it. Everything a peer wrote (names, devices, software) goes in as text, never as markup.
"use strict";

(() => {
  const SVG = "http://www.w3.org/2000/svg";
  const LANES_SHOWN = 12, STANDBY_SHOWN = 40, EVENTS_SHOWN = 300;
  const BOX_W = 180, BOX_H = 56, GAP_X = 124, GAP_Y = 48, LEFT = 64, TOP = 44;
  const COLOURS = { training: "#2e7d32", standby: "#7b8590", leaving: "#e07000", missing: "#c62828" };
  const $ = (id) => document.getElementById(id);
  let current = null, showAllLanes = false;
  const peerSort = { key: "device_id", down: false }, creditSort = { key: "rank", down: false };
  const creditView = { rows: "volunteers", span: "all" };  // the leaderboard's toggles

  // -- small helpers ------------------------------------------------------------------------------
  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    for (const child of children) node.append(child instanceof Node ? child : String(child));
    return node;
  }
  function svg(tag, attrs, text) {
    const node = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    if (text !== undefined) node.textContent = text;
    return node;
  }
  const missing = (v) => v === null || v === undefined || Number.isNaN(v);
  const num = (v, digits = 3) => (missing(v) ? "-" : Number(v).toPrecision(digits).replace(/\.?0+$/, (m) => (m.includes(".") ? "" : m)));
  const fixed = (v, digits) => (missing(v) ? "-" : Number(v).toFixed(digits));
  const grouped = (v) => (missing(v) ? "-" : Math.round(v).toLocaleString("en-US"));
  function rate(bytesPerS) {
    if (missing(bytesPerS)) return "-";
    const units = [[1e9, "GB/s"], [1e6, "MB/s"], [1e3, "kB/s"]];
    for (const [scale, unit] of units) if (bytesPerS >= scale) return `${num(bytesPerS / scale)} ${unit}`;
    return `${num(bytesPerS)} B/s`;
  }
  const latency = (s) => (missing(s) ? "-" : `${num(s * 1000, 2)} ms`);
  function when(t, clock) {
    if (missing(t)) return "-";
    return clock === "unix" ? new Date(t * 1000).toLocaleTimeString() : `${fixed(t, 1)} s`;
  }
  const shortName = (device) => { const i = device.lastIndexOf("-"); return i > 0 ? `${device.slice(0, i)}-${device.slice(i + 1, i + 5)}` : device; };
  const colour = (state) => COLOURS[state] || "#1565c0";

  // -- header and figures -------------------------------------------------------------------------
  function header(state) {
    $("swarm").textContent = `hetpeer · ${state.swarm}`;
    document.title = `hetpeer · ${state.swarm}`;
    const key = state.coordinator_key ? `coordinator ${state.coordinator_key.slice(0, 16)}` : "run report";
    $("subtitle").textContent = [key, state.admission ? `admission: ${state.admission}` : "", when(state.now, state.clock)]
      .filter(Boolean).join(" · ");
  }

  function figures(state) {
    const p = state.progress, peers = Object.entries(p.peers_by_state).map(([s, n]) => `${n} ${s}`).join(", ");
    const cards = [
      ["step", grouped(p.step)], ["loss", fixed(p.loss, 4)], ["validation loss", fixed(p.val_loss, 4)],
      ["tokens/s", grouped(p.tokens_per_s)], ["plan epoch", p.epoch >= 0 ? p.epoch : "none"],
      ["peers", `${Object.values(p.peers_by_state).reduce((a, b) => a + b, 0)}`],
      ["left out (banned)", `${p.refused ?? 0} (${p.banned ?? 0})`], ["records dropped", grouped(p.dropped)],
    ];
    const box = $("figures");
    box.replaceChildren(...cards.map(([label, value]) => el("div", { class: "figure", "data-figure": label },
      el("div", { class: "label" }, label), el("div", { class: "value" }, value))));
    box.title = peers;
  }

  // -- the plan as a picture ------------------------------------------------------------------------
  function planPicture(state) {
    const plan = state.plan, box = $("plan-picture");
    if (!plan) {
      $("plan-summary").textContent = "no plan yet: the coordinator waits for peers to settle";
      $("plan-recipe").textContent = "";
      box.replaceChildren();
      return;
    }
    const peers = new Map(state.peers.map((p) => [p.device_id, p]));
    const lanes = plan.stages[0].devices.length, stages = plan.stages.length;
    const shown = showAllLanes ? lanes : Math.min(lanes, LANES_SHOWN);
    const overhead = plan.overhead_s ? ` (${plan.overhead_s > 0 ? "+" : ""}${fixed(plan.overhead_s * 1e3, 0)} ms overhead included)` : "";
    const predicted = missing(plan.predicted_step_s) ? "no prediction" : `predicted ${fixed(plan.predicted_step_s, 3)} s/step${overhead}`;
    const measured = missing(plan.measured_step_s) ? "" : `, measured ${fixed(plan.measured_step_s, 3)} s/step`;
    const factor = plan.steps_factor > 1 ? `; steps factor ${fixed(plan.steps_factor, 2)} (a step is worth 1/${fixed(plan.steps_factor, 2)} of all-reduce's)` : "";
    const batch = plan.batch ? `, batch ${plan.batch} in ${plan.micro_batches} micro-batch(es) of ${plan.micro_batch}` : "";
    $("plan-summary").textContent = `epoch ${plan.epoch} from step ${plan.start_step}: ${stages} stage(s) x ${lanes} lane(s), ` +
      `${[plan.model, plan.dtype].filter(Boolean).join(" ")}${batch}; ${predicted}${measured}${factor}; ${plan.standby.length} on standby`;
    $("plan-recipe").textContent = plan.recipe_words ? `recipe: ${plan.recipe_words}` : "";

    const standbyShown = plan.standby.slice(0, STANDBY_SHOWN);
    const perRow = Math.max(stages, 4), standbyRows = Math.ceil(standbyShown.length / perRow);
    const width = LEFT + Math.max(stages, standbyShown.length ? perRow : 0) * (BOX_W + GAP_X);
    const gridBottom = TOP + shown * (BOX_H + GAP_Y);
    const height = gridBottom + (standbyRows ? 28 + standbyRows * (BOX_H + 16) : 0) + 8;
    const root = svg("svg", { width, height, viewBox: `0 0 ${width} ${height}`, role: "img", "aria-label": `plan epoch ${plan.epoch}` });
    const at = (s, l) => [LEFT + s * (BOX_W + GAP_X), TOP + l * (BOX_H + GAP_Y)];

    plan.stages.forEach((stage, s) => {
      const [x] = at(s, 0);
      // a stage whose work no group member can judge says so (docs/trust.md)
      const checked = { unchecked: " · unchecked", pair: " · checked in a pair" }[stage.checked] || "";
      root.append(svg("text", { x, y: 16, class: "head" }, `stage ${s}${checked}`));
      root.append(svg("text", { x, y: 32, class: "small" }, `layers ${stage.layers[0]}-${stage.layers[1] - 1} · ${stage.sync}${stage.hop ? ` · → ${stage.hop}` : ""}`));
    });
    // lanes of unlike speed take unlike shares of the batch: each lane's sequences a step under its name
    const shares = (plan.lane_batches || []).some((b) => b !== plan.lane_batches[0]) ? plan.lane_batches : null;
    for (let l = 0; l < shown; l++) {
      const y = at(0, l)[1] + BOX_H / 2 + 4;
      root.append(svg("text", { x: 4, y, class: "small" }, `lane ${l}`));
      if (shares) root.append(svg("text", { x: 4, y: y + 13, class: "small" }, `${shares[l]} seq`));
    }

    const bandwidths = plan.links.filter((k) => k.measured).map((k) => k.bandwidth_bytes_per_s);
    const widest = Math.max(...bandwidths, 1), narrowest = Math.min(...bandwidths, widest);
    const stroke = (k) => (k.measured ? 1.5 + 3.5 * (Math.log(k.bandwidth_bytes_per_s / narrowest + 1) / Math.log(widest / narrowest + 1 || 2)) : 1.5);
    // how the pair talks now: direct (said by no word), punched, relayed, not yet, or failed and how
    const path = (k) => (k.route === "failed" ? `failed: ${k.failed}` : k.route && k.route !== "direct" ? k.route : "");
    const figures = (k) => (k.measured ? `${rate(k.bandwidth_bytes_per_s)} · ${latency(k.latency_s)}` : k.estimated ? "estimated" : "not measured");
    const label = (k) => (k.route === "failed" ? path(k) : [path(k), figures(k)].filter(Boolean).join(" · "));
    const where = new Map();
    plan.stages.forEach((stage, s) => stage.devices.forEach((d, l) => where.set(d, [s, l])));
    const closing = [];
    for (const k of plan.links) {
      if (!where.has(k.from) || !where.has(k.to)) continue;  // a link of no stage: nothing to draw it between
      const [sa, la] = where.get(k.from), [sb, lb] = where.get(k.to);
      if (la >= shown || lb >= shown) continue;
      const line = { stroke: k.measured && k.route !== "failed" ? "#55606b" : "#c62828", "stroke-width": stroke(k), "data-link": k.kind };
      if (!k.measured || k.route === "failed") line["stroke-dasharray"] = "5 4";
      if (k.kind === "lane") {
        const [x1, y] = at(sa, la), x2 = at(sb, lb)[0];
        root.append(svg("line", { x1: x1 + BOX_W, y1: y + BOX_H / 2, x2, y2: y + BOX_H / 2, ...line }));
        root.append(svg("text", { x: x1 + BOX_W + GAP_X / 2, y: y + BOX_H / 2 - 7, "text-anchor": "middle", class: "small" }, label(k)));
      } else if (lb === la + 1) {
        const [x, y1] = at(sa, la), y2 = at(sb, lb)[1];
        root.append(svg("line", { x1: x + 24, y1: y1 + BOX_H, x2: x + 24, y2, ...line }));
        root.append(svg("text", { x: x + 32, y: y1 + BOX_H + GAP_Y / 2 + 4, class: "small" }, label(k)));
      } else {
        closing.push(`stage ${sa} lane ${la} to lane ${lb}: ${label(k)}`);
      }
    }
    const drawPeer = (device, x, y) => {
      const p = peers.get(device) || { state: "missing" };
      const g = svg("g", { "data-peer": device, "data-state": p.state });
      g.append(svg("title", {}, `${device}\n${p.device_name || ""}\n${p.admission || ""}`));
      g.append(svg("rect", { x, y, width: BOX_W, height: BOX_H, rx: 6, fill: "#fff", stroke: colour(p.state), "stroke-width": 2 }));
      g.append(svg("rect", { x, y, width: 6, height: BOX_H, rx: 3, fill: colour(p.state) }));
      g.append(svg("text", { x: x + 14, y: y + 20, class: "head" }, shortName(device)));
      g.append(svg("text", { x: x + 14, y: y + 38, class: "small" }, `${num(p.tflops)} TFLOPS · ${p.state}`));
      if (!missing(p.step)) g.append(svg("text", { x: x + 14, y: y + 51, class: "small" }, `step ${p.step}`));
      root.append(g);
    };
    for (let s = 0; s < stages; s++) for (let l = 0; l < shown; l++) drawPeer(plan.stages[s].devices[l], ...at(s, l));
    if (standbyShown.length) {
      root.append(svg("text", { x: LEFT, y: gridBottom + 16, class: "head" },
                      `standby (${plan.standby.length}${plan.standby.length > standbyShown.length ? `, ${standbyShown.length} shown` : ""})`));
      standbyShown.forEach((d, i) => drawPeer(d, LEFT + (i % perRow) * (BOX_W + GAP_X), gridBottom + 28 + Math.floor(i / perRow) * (BOX_H + 16)));
    }
    const parts = [root];
    if (closing.length) parts.push(el("p", { class: "muted" }, `ring links not drawn: ${closing.slice(0, 8).join("; ")}${closing.length > 8 ? "; ..." : ""}`));
    if (lanes > LANES_SHOWN) {
      const button = el("button", { type: "button" }, showAllLanes ? `show ${LANES_SHOWN} lanes` : `show all ${lanes} lanes`);
      button.addEventListener("click", () => { showAllLanes = !showAllLanes; planPicture(current); });
      parts.push(button);
    }
    box.replaceChildren(...parts);
  }

  // -- tables ---------------------------------------------------------------------------------------
  // `sort` ({key, down}) makes the headers sort: a click on one sorts by it, again the other way, then `redraw()`
  function table(node, columns, rows, sort, redraw) {
    const head = el("tr", {}, ...columns.map((c) => {
      const th = el("th", { class: (c.num ? "num " : "") + (sort && c.key === sort.key ? `sorted${sort.down ? " down" : ""}` : ""), "data-key": c.key }, c.label);
      if (sort) th.addEventListener("click", () => { sort.down = sort.key === c.key ? !sort.down : false; sort.key = c.key; redraw(); });
      return th;
    }));
    const body = document.createDocumentFragment();
    for (const row of rows) body.append(el("tr", row.attrs || {}, ...columns.map((c) => el("td", c.num ? { class: "num" } : {}, c.show(row)))));
    node.replaceChildren(el("thead", {}, head), el("tbody", {}, body));
  }

  function sortRows(rows, columns, sort) {
    const column = columns.find((c) => c.key === sort.key) || columns[0];
    const value = column.value || ((r) => r[column.key]);
    return rows.sort((a, b) => {
      const x = value(a), y = value(b);
      if (missing(x) !== missing(y)) return missing(x) ? 1 : -1;  // blanks last either way
      const order = typeof x === "number" && typeof y === "number" ? x - y : String(x).localeCompare(String(y));
      return sort.down ? -order : order;
    });
  }

  function plansTable(state) {
    const ratio = (p) => (missing(p.measured_step_s) || !p.predicted_step_s ? null : p.measured_step_s / p.predicted_step_s);
    table($("plans"), [
      { key: "epoch", label: "epoch", num: true, show: (p) => p.epoch },
      { key: "start_step", label: "from step", num: true, show: (p) => p.start_step },
      { key: "published", label: "published", show: (p) => when(p.published, state.clock) },
      { key: "shape", label: "stages x lanes", show: (p) => `${p.stages} x ${p.lanes}` },
      { key: "standby", label: "standby", num: true, show: (p) => p.standby },
      { key: "predicted", label: "predicted s/step", num: true, show: (p) => fixed(p.predicted_step_s, 3) },
      { key: "measured", label: "measured", num: true, show: (p) => fixed(p.measured_step_s, 3) },
      { key: "ratio", label: "ratio", num: true, show: (p) => fixed(ratio(p), 2) },
      { key: "steps", label: "steps", num: true, show: (p) => p.steps },
      { key: "reason", label: "why", show: (p) => p.reason },
    ], state.history.plans.slice().reverse(), null);
  }

  function events(state) {
    const items = state.history.events.slice(-EVENTS_SHOWN).reverse();
    $("events").replaceChildren(...(items.length ? items.map((e) => el("li", { "data-kind": e.kind },
      el("time", {}, when(e.time, state.clock)), el("span", { class: `badge ${e.kind}` }, e.kind), el("span", {}, e.text)))
      : [el("li", { class: "muted" }, "nothing yet")]));
  }

  const PEER_COLUMNS = [
    { key: "device_id", label: "peer", show: (p) => p.device_id },
    { key: "state", label: "state", show: (p) => el("span", { class: `badge ${p.state}` }, p.state) },
    { key: "place", label: "stage / lane", value: (p) => (p.stage === null ? (p.standby ? 1e9 : 2e9) : p.stage * 1e6 + p.lane),
      show: (p) => (p.stage !== null ? `${p.stage} / ${p.lane}`
        : p.standby ? el("span", { title: p.standby_reason || "" }, p.standby_reason ? `standby: ${p.standby_reason.split(":")[0]}` : "standby") : "-") },
    { key: "layers", label: "layers", value: (p) => (p.layers ? p.layers[0] : null), show: (p) => (p.layers ? `${p.layers[0]}-${p.layers[1] - 1}` : "-") },
    { key: "step", label: "step", num: true, show: (p) => (missing(p.step) ? "-" : p.step) },
    { key: "loss", label: "loss", num: true, show: (p) => fixed(p.loss, 4) },
    { key: "tokens_per_s", label: "tokens/s", num: true, show: (p) => grouped(p.tokens_per_s) },
    { key: "tflops", label: "TFLOPS", num: true, show: (p) => num(p.tflops) },
    { key: "achieved_tflops", label: "achieved", num: true, show: (p) => num(p.achieved_tflops) },
    { key: "memory_bytes", label: "memory GB", num: true, show: (p) => (missing(p.memory_bytes) ? "-" : fixed(p.memory_bytes / 1e9, 1)) },
    { key: "links", label: "links", num: true, show: (p) => (missing(p.links) ? "-" : p.links) },
    { key: "age_s", label: "age s", num: true, show: (p) => fixed(p.age_s, 0) },
    { key: "device_name", label: "device", show: (p) => p.device_name || "-" },
    { key: "reachable", label: "reachable", show: (p) => el("span", { title: [["punched", p.punched], ["relayed", p.relayed]]
        .filter(([, peers]) => peers && peers.length).map(([how, peers]) => `${how}: ${peers.join(", ")}`).join("\n") }, p.reach || p.reachable || "-") },
    { key: "software", label: "software", show: (p) => p.software || "-" },
    { key: "admission", label: "admission", show: (p) => p.admission + (p.suspects && p.suspects.length ? ` · reports ${p.suspects.join(", ")}` : "") },
  ];

  function peersTable(state) {
    const filter = $("peer-filter").value.trim().toLowerCase();
    const rows = state.peers.filter((p) => !filter || [p.device_id, p.state, p.device_name || "", p.admission].some((t) => t.toLowerCase().includes(filter)));
    sortRows(rows, PEER_COLUMNS, peerSort);
    // a run report knows less of its peers than a coordinator: leave out what it has for none
    const columns = state.clock === "run" ? PEER_COLUMNS.filter((c) => state.peers.some((p) => !missing((c.value || ((q) => q[c.key]))(p)))) : PEER_COLUMNS;
    table($("peers"), columns, rows, peerSort, () => peersTable(current));
  }

  // -- the credit leaderboard: work confirmed by neighbours (coordinator/ledger.py) ------------------
  const hours = (s) => fixed(missing(s) ? s : s / 3600, 2);
  const CREDIT_SHARED = [
    { key: "tokens", label: "tokens", num: true, show: (r) => grouped(r.tokens) },
    { key: "tflop", label: "TFLOP", num: true, value: (r) => r.flops, show: (r) => num(missing(r.flops) ? r.flops : r.flops / 1e12) },
    { key: "training_s", label: "hours training", num: true, show: (r) => hours(r.training_s) },
    { key: "online_s", label: "hours online", num: true, show: (r) => hours(r.online_s) },
  ];
  const CREDIT_COLUMNS = {
    volunteers: [
      { key: "rank", label: "#", num: true, show: (r) => r.rank },
      { key: "name", label: "volunteer", show: (r) => el("span", { title: r.device_id }, r.name,
        ...(r.suspect ? [el("span", { class: "badge suspect", title: "claimed work its neighbours did not confirm, round after round: " +
          `it is credited only what they confirm (${grouped(r.claimed_sequences)} sequences claimed in the open epochs)` }, "suspect")] : [])) },
      { key: "team", label: "team", show: (r) => r.team || "-" },
      ...CREDIT_SHARED,
    ],
    teams: [
      { key: "rank", label: "#", num: true, show: (r) => r.rank },
      { key: "team", label: "team", show: (r) => r.team },
      { key: "volunteers", label: "volunteers", num: true, show: (r) => r.volunteers },
      ...CREDIT_SHARED,
    ],
  };

  function creditTable(state) {
    const panel = $("credit-panel"), credit = state.credit;
    panel.hidden = !credit;  // a run report has no ledger
    if (!credit) return;
    const hour = creditView.span === "hour";
    // the chosen span's work, ranked by tokens (then FLOPs), before the table sorts by whatever column
    const rows = credit[creditView.rows].map((r) => ({ ...r, tokens: hour ? r.last_hour_tokens : r.tokens, flops: hour ? r.last_hour_flops : r.flops,
                                                      attrs: r.suspect ? { "data-suspect": "" } : {} }));
    rows.sort((a, b) => b.tokens - a.tokens || b.flops - a.flops).forEach((r, i) => { r.rank = i + 1; });
    const columns = CREDIT_COLUMNS[creditView.rows];
    sortRows(rows, columns, creditSort);
    table($("credit"), columns, rows, creditSort, () => creditTable(current));
    for (const button of panel.querySelectorAll("[data-credit-rows]")) button.setAttribute("aria-pressed", String(button.dataset.creditRows === creditView.rows));
    for (const button of panel.querySelectorAll("[data-credit-span]")) button.setAttribute("aria-pressed", String(button.dataset.creditSpan === creditView.span));
    const total = rows.reduce((sum, r) => sum + (r.tokens || 0), 0), suspects = credit.volunteers.filter((r) => r.suspect).length;
    $("credit-summary").textContent = credit.volunteers.length
      ? `${credit.volunteers.length} volunteer(s), ${credit.teams.length} team(s); ${grouped(total)} tokens confirmed by neighbours ` +
        `${hour ? "in the last hour" : "in all"}${suspects ? `; ${suspects} suspect(s)` : ""} · as of ${when(credit.time, state.clock)}`
      : "no credit yet: no neighbour has confirmed any peer's work";
  }

  // -- drawing it all, and keeping it live ----------------------------------------------------------
  function render(state) {
    current = state;
    header(state);
    figures(state);
    planPicture(state);
    const drawn = hetpeerCharts.draw($("chart-loss"), $("chart-rate"), state.history, state.clock);
    plansTable(state);
    events(state);
    peersTable(state);
    creditTable(state);
    document.body.dataset.version = state.version;
    document.body.dataset.points = drawn.points;
    if (!document.body.dataset.rendered) {
      document.body.dataset.rendered = String(performance.now());
      performance.mark("hetpeer-rendered");
    }
  }

  function setLive(text, on) {
    const live = $("live");
    live.textContent = text;
    live.className = `live ${on ? "on" : "off"}`;
  }

  async function fetchState() {
    let state;
    try {
      const reply = await fetch("api/state", { cache: "no-store" });
      if (!reply.ok) throw new Error(`${reply.status}`);
      state = await reply.json();
    } catch (error) {
      setLive(`cannot reach the coordinator (${error.message}): retrying`, false);
      return;
    }
    try {
      render(state);
      setLive(`live · updated ${new Date().toLocaleTimeString()}`, true);
    } catch (error) {
      setLive(`cannot draw what the coordinator sent (${error.message})`, false);
      throw error;  // and in the browser's console, with where
    }
  }

  function follow() {
    let fetching = false, again = false, lastMessage = Date.now();
    const refresh = async () => {
      if (fetching) { again = true; return; }
      fetching = true;
      do { again = false; await fetchState(); } while (again);
      fetching = false;
    };
    const stream = new EventSource("api/stream");
    stream.onmessage = (message) => {
      lastMessage = Date.now();
      const version = JSON.parse(message.data).version;
      if (!current || version !== current.version) refresh();
    };
    stream.onerror = () => setLive("connection lost: reconnecting", false);
    setInterval(() => { if (Date.now() - lastMessage > 20000) refresh(); }, 10000);  // streams blocked on the way: poll
    refresh();
  }

  document.addEventListener("DOMContentLoaded", () => {
    $("peer-filter").addEventListener("input", () => current && peersTable(current));
    for (const button of document.querySelectorAll("[data-credit-rows], [data-credit-span]")) {
      button.addEventListener("click", () => {
        if (button.dataset.creditRows) creditView.rows = button.dataset.creditRows;
        else creditView.span = button.dataset.creditSpan;
        if (current) creditTable(current);
      });
    }
    const inline = document.getElementById("state");
    if (inline) $("credit-csv").hidden = true;  // a file has no server to export from
    if (inline) {
      render(JSON.parse(inline.textContent));
      setLive("run report", true);
    } else if (new URLSearchParams(location.search).has("once")) {
      fetchState();  // one picture, no stream (a screenshot's page: an open stream keeps it loading)
    } else {
      follow();
    }
  });
})();
