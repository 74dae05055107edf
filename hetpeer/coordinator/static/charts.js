// Loss, validation loss, tokens/s and the gradient noise scale over time, plan switches marked: drawn with plotly.js from a
// dashboard document's history (the coordinator's page and the swarm's run report draw the same).
"use strict";

const hetpeerCharts = (() => {
  const LOSS = "#1f77b4", VAL = "#ff7f0e", RATE = "#2ca02c", NOISE = "#9467bd", SWITCH = "#8a939c";

  function columns(history) {
    const at = {};
    history.sample_fields.forEach((name, i) => { at[name] = i; });
    const pick = (name) => history.samples.map((s) => s[at[name]]);
    return { time: pick("time"), step: pick("step"), epoch: pick("epoch"), loss: pick("loss"),
             val: pick("val_loss"), rate: pick("tokens_per_s"), noise: at.noise_scale === undefined ? [] : pick("noise_scale") };
  }

  // unix clocks show as dates; a run's clock counts seconds from its start
  const xOf = (clock) => (t) => (clock === "unix" ? new Date(t * 1000) : t);

  // a plan switch is where the swarm first ran the plan's epoch, or where it was published
  function switches(history, c) {
    return history.plans.slice(1).map((plan) => {
      const i = c.epoch.findIndex((e, j) => e === plan.epoch && c.step[j] >= plan.start_step);
      return { time: i >= 0 ? c.time[i] : plan.published, epoch: plan.epoch };
    });
  }

  function layout(title, yTitle, clock, marks, x, fromZero) {
    return {
      title: { text: title, font: { size: 14 } }, margin: { l: 60, r: 16, t: 36, b: 40 },
      xaxis: { title: { text: clock === "unix" ? "" : "seconds since the start" }, type: clock === "unix" ? "date" : "linear" },
      yaxis: { title: { text: yTitle }, rangemode: fromZero ? "tozero" : "normal" }, legend: { orientation: "h", y: -0.18 },
      hovermode: "x unified", paper_bgcolor: "rgba(0,0,0,0)", plot_bgcolor: "#fff",
      shapes: marks.map((m) => ({ type: "line", xref: "x", yref: "paper", x0: x(m.time), x1: x(m.time), y0: 0, y1: 1,
                                  line: { color: SWITCH, width: 1, dash: "dash" } })),
      annotations: marks.map((m) => ({ x: x(m.time), y: 1, xref: "x", yref: "paper", text: `epoch ${m.epoch}`,
                                       showarrow: false, xanchor: "left", yanchor: "top", font: { size: 10, color: SWITCH } })),
    };
  }

  function trace(name, xs, ys, steps, color, extra) {
    return Object.assign({ type: "scatter", mode: "lines", name, x: xs, y: ys, customdata: steps, connectgaps: true,
                           line: { color, width: 2 }, hovertemplate: `%{y:.4g} (step %{customdata})<extra>${name}</extra>` }, extra);
  }

  // Draw (or update in place) both charts. `history`: {sample_fields, samples, plans}; `clock`: "unix" or "run".
  function draw(lossEl, rateEl, history, clock) {
    const c = columns(history), x = xOf(clock), xs = c.time.map(x), marks = switches(history, c);
    const valAt = c.val.map((v, i) => (v === null ? -1 : i)).filter((i) => i >= 0);
    const losses = [trace("loss", xs, c.loss, c.step, LOSS)];
    if (valAt.length) {
      losses.push(trace("validation loss", valAt.map((i) => xs[i]), valAt.map((i) => c.val[i]), valAt.map((i) => c.step[i]), VAL,
                        { mode: "lines+markers", marker: { size: 5 } }));
    }
    const config = { responsive: true, displaylogo: false, displayModeBar: "hover", modeBarButtonsToRemove: ["lasso2d", "select2d"] };
    Plotly.react(lossEl, losses, layout("training loss", "loss", clock, marks, x, false), config);
    const rates = [trace("tokens/s", xs, c.rate, c.step, RATE, { fill: "tozeroy", fillcolor: "rgba(44,160,44,0.12)" })];
    const rateLayout = layout("throughput", "tokens/s", clock, marks, x, true);
    const noiseAt = c.noise.map((v, i) => (v === null || v === undefined ? -1 : i)).filter((i) => i >= 0);
    if (noiseAt.length) {  // the gradient noise scale all-reduce groups measure, on its own (log) axis
      rates.push(trace("gradient noise scale", noiseAt.map((i) => xs[i]), noiseAt.map((i) => c.noise[i]),
                       noiseAt.map((i) => c.step[i]), NOISE, { yaxis: "y2", line: { color: NOISE, width: 2, dash: "dot" } }));
      rateLayout.title.text = "throughput and gradient noise scale";
      rateLayout.yaxis2 = { title: { text: "noise scale (tokens)" }, overlaying: "y", side: "right", type: "log", showgrid: false };
      rateLayout.margin.r = 60;
    }
    Plotly.react(rateEl, rates, rateLayout, config);
    return { points: xs.length, switches: marks.length };
  }

  return { draw, columns };
})();
