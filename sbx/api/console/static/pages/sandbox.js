// One sandbox: how it stands (state, memoryRestored, resumeReason, last stop), memory and CPU graphs over the
// last hour (GET /v1/sandboxes/{id}/stats, drawn with uPlot), hosted ports with copy buttons, jobs with their
// logs, snapshots and the events timeline. Refreshed every few seconds.
import uPlot from "../vendor/uPlot.js";
import { api, ndjson, sid } from "../api.js";
import { age, attempt, bytes, copyText, h, stateBadge } from "../util.js";

const POLL_MS = 5000;

function facts(sb) {
  const dl = h("dl", { class: "facts", id: "facts" });
  const add = (k, v) => dl.append(h("dt", {}, k), h("dd", { "data-fact": k }, v ?? "–"));
  add("State", stateBadge(sb.state));
  add("Size", `${sb.type}: ${sb.memoryGB} GB, ${sb.vcpus} vCPU, ${sb.diskGB} GB disk`);
  add("Age", age(sb.createdAt));
  add("Image", sb.image ?? "sbx default (Debian)");
  add("Runtime", sb.runtime ?? "container");
  add("memoryRestored", sb.memoryRestored === null ? "null" : String(sb.memoryRestored));
  add("resumeReason", sb.resumeReason ?? "null");
  add("Last stop", sb.memorySaved === null || sb.memorySaved === undefined ? "–"
    : `${sb.stopReason || "?"}, memory ${sb.memorySaved ? "saved" : "not saved"}${sb.stopError ? `: ${sb.stopError}` : ""}`);
  add("TTL", sb.ttl ? `${sb.ttl} s` : "none");
  add("autoResume", String(sb.autoResume));
  add("Disk", `${sb.stats.diskUsedMb} MiB used inside; ${bytes(sb.stats.diskAllocatedBytes)} on the volume`);
  if (sb.error) add("Error", `${sb.error.code}: ${sb.error.message}`);
  if (Object.keys(sb.labels || {}).length) add("Labels", Object.entries(sb.labels).map(([k, v]) => `${k}=${v}`).join(", "));
  return dl;
}

function chart(el, title, unit, color) {
  const opts = {
    title, width: Math.max(260, el.clientWidth || 600), height: 180,
    scales: { x: { time: true }, y: { range: (u, min, max) => [0, Math.max(max * 1.1, unit === "%" ? 5 : 64)] } },
    series: [{}, { label: unit, stroke: color, fill: `${color}22`, width: 2, points: { show: true, size: 4 } }],
    axes: [{}, { label: unit, size: 60 }],
    legend: { show: true },
  };
  const plot = new uPlot(opts, [[], []], el);
  const ro = new ResizeObserver(() => plot.setSize({ width: Math.max(260, el.clientWidth), height: 180 }));
  ro.observe(el);
  return { plot, ro };
}

function routesBlock(id, routes) {
  return h("ul", { class: "items", id: "routes" }, routes.length ? routes.map((r) => {
    const btn = h("button", { type: "button", class: "secondary small", "data-copy": r.url }, "Copy URL");
    btn.addEventListener("click", () => copyText(r.url, btn));
    const items = [h("b", {}, `:${r.port}`), " ", h("code", {}, r.url), " ", r.public ? "public" : "private", " ", btn];
    if (!r.public) {
      const tb = h("button", { type: "button", class: "secondary small" }, "Copy token");
      tb.addEventListener("click", () => copyText(r.token, tb));
      items.push(" ", tb);
    }
    const un = h("button", { type: "button", class: "danger small" }, "Unhost");
    un.addEventListener("click", () => attempt(() => api("DELETE", `/v1/sandboxes/${id}/routes/${r.port}`)));
    items.push(" ", un);
    return h("li", {}, items);
  }) : h("li", { class: "empty" }, "No hosted ports."));
}

function hostForm(id, refresh) {
  const form = h("form", { class: "inline" },
    h("input", { name: "port", type: "number", min: "1", max: "65535", placeholder: "port", required: true }),
    h("label", { class: "check" }, h("input", { name: "public", type: "checkbox" }), "public"),
    h("button", { type: "submit", class: "secondary" }, "Host port"));
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const f = new FormData(form);
    await attempt(() => api("POST", `/v1/sandboxes/${id}/routes`, { port: Number(f.get("port")), public: f.get("public") === "on" }));
    refresh();
  });
  return form;
}

function jobsBlock(id, jobs, logs) {
  return h("ul", { class: "items", id: "jobs" }, jobs.length ? jobs.map((j) => {
    const show = h("button", { type: "button", class: "secondary small" }, "Logs");
    show.addEventListener("click", () => attempt(async () => {
      const lines = await ndjson(`/v1/sandboxes/${id}/jobs/${sid(j.id)}/logs`);
      logs.textContent = lines.map((l) => (l.data !== undefined ? l.data : `[exit ${l.exitCode}]\n`)).join("");
      logs.hidden = false;
      logs.dataset.job = j.id;
    }));
    return h("li", {}, h("code", {}, j.command), " ", j.running ? "running" : `exit ${j.exitCode}`, " ",
      h("span", { class: "sub" }, j.startedAt), " ", show);
  }) : h("li", { class: "empty" }, "No jobs."));
}

function snapshotsBlock(snaps) {
  return h("ul", { class: "items", id: "snapshots" }, snaps.length ? snaps.map((s) =>
    h("li", {}, h("b", {}, s.name), s.auto ? " (auto) " : " ", h("span", { class: "sub" }, `${s.createdAt}, ${bytes(s.uniqueBytes)} unique`)))
    : h("li", { class: "empty" }, "No snapshots."));
}

function eventText(ev) {
  if (ev.event === "error") return `error ${ev.error?.code}: ${ev.error?.message}`;
  if (ev.event === "exited") return `exited (${ev.reason})${ev.detail ? `: ${ev.detail}` : ""}`;
  if (ev.event === "forking") return `forking from ${ev.source}`;
  if (ev.event === "ready") return "ready (running)";
  return `${ev.event}${ev.state ? ` → ${ev.state}` : ""}`;
}

export function render(root, [sandboxId]) {
  const id = sid(sandboxId);
  const head = h("div", { class: "head" }, h("h1", {}, sandboxId),
    h("div", { class: "actions" },
      h("a", { class: "button secondary", href: `#/terminal/${id}` }, "Terminal"),
      h("a", { class: "button secondary", href: `#/files/${id}` }, "Files")));
  const factsBox = h("div");
  const memEl = h("div", { class: "chart", id: "chart-memory" });
  const cpuEl = h("div", { class: "chart", id: "chart-cpu" });
  const routesBox = h("div");
  const jobsBox = h("div");
  const logs = h("pre", { class: "logs", id: "job-logs", hidden: true });
  const snapsBox = h("div");
  const events = h("ol", { class: "timeline", id: "events" });
  let stopped = false;
  const refresh = () => load();
  root.append(head, factsBox,
    h("section", {}, h("h2", {}, "Memory and CPU, last hour"), h("div", { class: "charts" }, memEl, cpuEl)),
    h("section", {}, h("h2", {}, "Hosted ports"), routesBox, hostForm(id, refresh)),
    h("section", {}, h("h2", {}, "Jobs"), jobsBox, logs),
    h("section", {}, h("h2", {}, "Snapshots"), snapsBox),
    h("section", {}, h("h2", {}, "Events"), events));
  const mem = chart(memEl, "Memory used", "MiB", "#2f6fdf");
  const cpu = chart(cpuEl, "CPU", "%", "#d9482b");
  let seq = 0;

  async function load() {
    if (stopped) return;
    try {
      const { sandbox } = await api("GET", `/v1/sandboxes/${id}`);
      factsBox.replaceChildren(h("h2", {}, sandbox.name), facts(sandbox));
      const series = await api("GET", `/v1/sandboxes/${id}/stats?seconds=3600`);
      if (stopped) return;  // the page was left while this was loading: its plots are gone
      const t = series.samples.map((s) => s.at);
      mem.plot.setData([t, series.samples.map((s) => s.memoryUsedMb)]);
      cpu.plot.setData([t, series.samples.map((s) => s.cpuPercent)]);
      memEl.dataset.points = cpuEl.dataset.points = String(t.length);
      const [{ routes }, { snapshots }] = await Promise.all([
        api("GET", `/v1/sandboxes/${id}/routes`), api("GET", `/v1/sandboxes/${id}/snapshots`)]);
      routesBox.replaceChildren(routesBlock(id, routes));
      snapsBox.replaceChildren(snapshotsBlock(snapshots));
      if (sandbox.state === "running") {
        const { jobs } = await api("GET", `/v1/sandboxes/${id}/jobs`);
        jobsBox.replaceChildren(jobsBlock(id, jobs, logs));
      } else {
        jobsBox.replaceChildren(h("p", { class: "empty" }, "Jobs are listed while the sandbox runs."));
      }
      for (const ev of await ndjson(`/v1/sandboxes/${id}/events?after=${seq}`)) {
        seq = Math.max(seq, ev.seq);
        events.prepend(h("li", { "data-event": ev.event }, h("span", { class: "sub" }, `#${ev.seq}`), " ", eventText(ev)));
      }
    } catch (e) {
      if (!stopped && e.status !== 401) attempt(() => { throw e; });
    }
  }
  load();
  const timer = setInterval(load, POLL_MS);
  return () => {
    stopped = true;
    clearInterval(timer);
    mem.ro.disconnect(); cpu.ro.disconnect();
    mem.plot.destroy(); cpu.plot.destroy();
  };
}
