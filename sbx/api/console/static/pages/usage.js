// Usage: cost and GiB-hours per UTC day and per size over a chosen range (GET /v1/usage?by=day, each day with its
// bySize split; drawn with uPlot as pages/sandbox.js draws its graphs), the range's totals per size, and the plan's
// limits with what the account uses now (GET /v1/account, what `sbx plan` shows). An account's key sees its own
// account; the installation's admin key sees every account's use and its own account's plan.
import uPlot from "../vendor/uPlot.js";
import { api } from "../api.js";
import { attempt, h } from "../util.js";

const DAY = 86400;
const COLORS = { small: "#2f6fdf", default: "#1e9e6a", large: "#d9482b", xlarge: "#8a4fd0", storage: "#888888" };

const isoDay = (d) => d.toISOString().slice(0, 10);
const money = (x) => `$${x.toFixed(6)}`;

function chart(el, title, unit, sizes) {
  const opts = {
    title, width: Math.max(260, el.clientWidth || 600), height: 220,
    scales: { x: { time: true }, y: { range: (u, min, max) => [0, Math.max(max * 1.15, 1e-6)] } },
    series: [{}, ...sizes.map((s) => ({ label: s, stroke: COLORS[s] || "#444", fill: `${COLORS[s] || "#444"}22`,
      width: 2, points: { show: true, size: 6 } }))],
    // small figures (a few thousandths of a dollar) keep two significant digits instead of rounding to 0
    axes: [{}, { label: unit, size: 80, values: (u, ticks) => ticks.map((v) => (v ? Number(v.toPrecision(2)).toString() : "0")) }],
    legend: { show: true },
  };
  const plot = new uPlot(opts, [[], ...sizes.map(() => [])], el);
  const ro = new ResizeObserver(() => plot.setSize({ width: Math.max(260, el.clientWidth), height: 220 }));
  ro.observe(el);
  return { plot, ro };
}

// Every UTC day from `from` (inclusive) to `to` (exclusive), with its figures per size (zeros where nothing ran).
function perDay(usage, from, to, sizes, pick) {
  const byKey = new Map(usage.groups.map((g) => [g.key, g.bySize || {}]));
  const xs = [];
  const ys = sizes.map(() => []);
  for (let t = Date.parse(`${from}T00:00:00Z`) / 1000; t < Date.parse(`${to}T00:00:00Z`) / 1000; t += DAY) {
    xs.push(t);
    const split = byKey.get(isoDay(new Date(t * 1000))) || {};
    sizes.forEach((s, i) => ys[i].push(split[s] ? pick(split[s], s) : 0));
  }
  return [xs, ...ys];
}

function totalsTable(usage) {
  const rows = Object.entries(usage.bySize || {}).map(([size, f]) =>
    h("tr", { "data-size": size },
      h("td", { "data-label": "Size" }, size),
      h("td", { "data-label": "Seconds running", class: "num" }, f.runningSeconds.toFixed(0)),
      h("td", { "data-label": "Running GiB-h", class: "num" }, f.runningGiBHours.toFixed(4)),
      h("td", { "data-label": "Stored GiB-h", class: "num" }, f.storedGiBHours.toFixed(4)),
      h("td", { "data-label": "Cost", class: "num" }, money(f.cost))));
  const t = usage.total;
  rows.push(h("tr", { "data-size": "total" }, h("td", { "data-label": "Size" }, h("strong", {}, "total")),
    h("td", { "data-label": "Seconds running", class: "num" }, t.runningSeconds.toFixed(0)),
    h("td", { "data-label": "Running GiB-h", class: "num" }, t.runningGiBHours.toFixed(4)),
    h("td", { "data-label": "Stored GiB-h", class: "num" }, t.storedGiBHours.toFixed(4)),
    h("td", { "data-label": "Cost", class: "num", id: "usage-total-cost" }, h("strong", {}, money(t.cost)))));
  return h("table", { class: "list", id: "usage-totals" },
    h("thead", {}, h("tr", {}, ["Size", "Seconds running", "Running GiB-h", "Stored GiB-h", "Cost"].map((c) => h("th", {}, c)))),
    h("tbody", {}, rows));
}

function limit(n, unit = "") { return n ? `${n}${unit}` : "no limit"; }

function planTable({ account, plan, used }) {
  const line = (name, lim, now) => h("tr", { "data-limit": name },
    h("td", { "data-label": "" }, name), h("td", { "data-label": "Limit" }, lim), h("td", { "data-label": "Used", class: "num" }, now));
  return h("table", { class: "list", id: "plan-limits" },
    h("thead", {}, h("tr", {}, ["", "Limit", "Used"].map((c) => h("th", {}, c)))),
    h("tbody", {},
      line("account", account.name, account.id),
      line("plan", `${plan.name} ($${plan.priceUsdMonth}/month)`, ""),
      line("sizes", plan.sizes.length ? plan.sizes.join(", ") : "all", ""),
      line("starts per hour", limit(plan.startsPerHour), String(used.startsLastHour)),
      line("running at once", limit(plan.running), String(used.running)),
      line("included storage", limit(plan.storageGiB, " GiB"), `${used.storedGiB.toFixed(3)} GiB`)));
}

export function render(root) {
  const today = new Date();
  const week = new Date(today.getTime() - 6 * DAY * 1000);
  const form = h("form", { class: "create", id: "usage-range" },
    h("label", {}, "From (UTC day)", h("input", { name: "from", type: "date", value: isoDay(week), required: true })),
    h("label", {}, "To (included)", h("input", { name: "to", type: "date", value: isoDay(today), required: true })),
    h("button", { type: "submit" }, "Show"));
  const costEl = h("div", { class: "chart", id: "chart-cost" });
  const gibEl = h("div", { class: "chart", id: "chart-gibh" });
  const totals = h("div");
  const range = h("p", { class: "sub", id: "usage-range-text" });
  const planBox = h("div");
  root.append(h("h1", {}, "Usage"),
    h("section", {}, h("h2", {}, "Plan and limits"), planBox),
    h("section", {}, h("h2", {}, "Cost and GiB-hours per day"), form, range,
      h("div", { class: "charts" }, costEl, gibEl)),
    h("section", {}, h("h2", {}, "Totals per size"), totals));
  let charts = [];
  let stopped = false;

  async function load() {
    const f = new FormData(form);
    const from = f.get("from");
    const last = f.get("to");
    if (!from || !last) return;
    const to = isoDay(new Date(Date.parse(`${last}T00:00:00Z`) + DAY * 1000));  // the API's `to` is exclusive
    await attempt(async () => {
      const [usage, mine] = await Promise.all([
        api("GET", `/v1/usage?by=day&from=${from}&to=${to}`), api("GET", "/v1/account")]);
      if (stopped) return;
      planBox.replaceChildren(planTable(mine));
      totals.replaceChildren(totalsTable(usage));
      range.textContent = `${usage.from} to ${usage.to}, ${usage.priceModel} prices, ${usage.currency}` +
        (usage.account ? "" : " (every account: the admin key)");
      const sizes = Object.keys(usage.bySize || {});
      for (const c of charts) { c.ro.disconnect(); c.plot.destroy(); }
      costEl.replaceChildren();
      gibEl.replaceChildren();
      const cost = chart(costEl, "Cost per day", usage.currency || "USD", sizes);
      const gibh = chart(gibEl, "GiB-hours per day (running; storage: stored)", "GiB-h", sizes);
      const costData = perDay(usage, from, to, sizes, (x) => x.cost);
      cost.plot.setData(costData);
      gibh.plot.setData(perDay(usage, from, to, sizes,
        (x, s) => (s === "storage" ? x.storedGiBHours : x.runningGiBHours)));
      costEl.dataset.points = String(costData.slice(1).flat().filter((v) => v > 0).length);
      gibEl.dataset.days = costEl.dataset.days = String(costData[0].length);
      charts = [cost, gibh];
    });
  }
  form.addEventListener("submit", (ev) => { ev.preventDefault(); load(); });
  load();
  return () => {
    stopped = true;
    for (const c of charts) { c.ro.disconnect(); c.plot.destroy(); }
  };
}
