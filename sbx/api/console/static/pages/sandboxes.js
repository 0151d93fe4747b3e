// Sandboxes: the list (state, size, age, live memory and CPU, cost so far from GET /v1/usage?by=sandbox, polled
// every few seconds), the create form and the lifecycle buttons. Errors are shown as the API words them.
import { api, sid } from "../api.js";
import { SIZES, age, ask, attempt, h, showInfo, stateBadge } from "../util.js";

const POLL_MS = 3000;

function actions(sb, refresh) {
  const id = sid(sb.id);
  const act = (label, fn, extra = {}) =>
    h("button", { type: "button", class: extra.class || "secondary", "data-action": label.toLowerCase(),
      onclick: async (ev) => { ev.target.disabled = true; await attempt(fn); ev.target.disabled = false; refresh(); } },
    label);
  const out = [
    h("a", { class: "button secondary", href: `#/sandbox/${id}`, "data-action": "open" }, "Open"),
    h("a", { class: "button secondary", href: `#/terminal/${id}`, "data-action": "terminal" }, "Terminal"),
    h("a", { class: "button secondary", href: `#/files/${id}`, "data-action": "files" }, "Files"),
  ];
  if (sb.state === "running") out.push(act("Stop", () => api("POST", `/v1/sandboxes/${id}/stop`, {})));
  if (sb.state === "stopped" || sb.state === "error") {
    out.push(act("Resume", async () => {
      const v = await ask(`Resume ${sb.name}`, [{ name: "type", label: "Size (a bigger one resizes, cold boot)",
        options: SIZES.slice(SIZES.indexOf(sb.type) >= 0 ? SIZES.indexOf(sb.type) : 0), value: sb.type }], "Resume");
      if (!v) return;
      await api("POST", `/v1/sandboxes/${id}/resume`, v.type !== sb.type ? { type: v.type } : {});
    }));
  }
  out.push(act("Fork", async () => {
    const v = await ask(`Fork ${sb.name}`, [{ name: "name", label: "Name", value: `${sb.name} (fork)` },
      { name: "type", label: "Size", options: SIZES, value: sb.type }], "Fork");
    if (!v) return;
    const { sandbox } = await api("POST", `/v1/sandboxes/${id}/fork`, { name: v.name, type: v.type });
    showInfo(`forking into ${sandbox.id}`);
  }));
  out.push(act("Snapshot", async () => {
    const v = await ask(`Snapshot ${sb.name}`, [{ name: "name", label: "Snapshot name", required: true,
      placeholder: "letters, digits, . _ -" }], "Save");
    if (!v) return;
    const { snapshot } = await api("POST", `/v1/sandboxes/${id}/snapshot`, { name: v.name });
    showInfo(`snapshot ${snapshot.name} saved`);
  }));
  out.push(act("Delete", async () => {
    if (!confirm(`Delete ${sb.name} (${sb.id}) and its disk?`)) return;
    await api("DELETE", `/v1/sandboxes/${id}`);
  }, { class: "danger" }));
  return h("div", { class: "actions" }, out);
}

function row(sb, refresh, costs) {
  const st = sb.stats || {};
  const running = sb.state === "running";
  return h("tr", { "data-id": sb.id, "data-state": sb.state },
    h("td", { "data-label": "Name" }, h("a", { href: `#/sandbox/${sid(sb.id)}` }, sb.name), h("div", { class: "sub" }, sb.id)),
    h("td", { "data-label": "State" }, stateBadge(sb.state)),
    h("td", { "data-label": "Size" }, `${sb.type}`, h("div", { class: "sub" }, `${sb.memoryGB ?? "?"} GB, ${sb.vcpus ?? "?"} vCPU`)),
    h("td", { "data-label": "Age" }, age(sb.createdAt)),
    h("td", { "data-label": "Memory", class: "num" }, running ? `${st.memoryUsedMb} / ${st.memoryTotalMb} MiB` : "–"),
    h("td", { "data-label": "CPU", class: "num" }, running ? `${st.cpuPercent.toFixed(1)} %` : "–"),
    h("td", { "data-label": "Cost so far", class: "num cost" }, costs.has(sb.id) ? `$${costs.get(sb.id).toFixed(6)}` : "$0"),
    h("td", { "data-label": "" }, actions(sb, refresh)));
}

function createForm(refresh) {
  const snapSelect = h("select", { name: "fromSnapshot" }, h("option", { value: "" }, "(fresh image)"));
  const imageSelect = h("select", { name: "image" }, h("option", { value: "" }, "sbx default (Debian)"));
  // the runtime classes the account's plan allows; none chosen: the server's default for the plan
  const runtimeSelect = h("select", { name: "runtime" }, h("option", { value: "" }, "(default)"));
  attempt(async () => {
    const { plan } = await api("GET", "/v1/account");
    for (const r of plan.runtimes || []) runtimeSelect.append(h("option", { value: r }, r));
    const { snapshots } = await api("GET", "/v1/snapshots");
    for (const s of snapshots) snapSelect.append(h("option", { value: s.name }, `${s.name}${s.auto ? " (auto)" : ""}`));
    const { images } = await api("GET", "/v1/images");
    for (const i of images) imageSelect.append(h("option", { value: i.name }, `${i.name}${i.shared ? " (shared)" : ""}`));
  });
  const form = h("form", { class: "create", id: "create-form" },
    h("label", {}, "Size", h("select", { name: "type" }, SIZES.map((s) => h("option", { value: s, selected: s === "small" }, s)))),
    h("label", {}, "Name", h("input", { name: "name", placeholder: "optional" })),
    h("label", {}, "Image", imageSelect),
    h("label", {}, "Runtime", runtimeSelect),
    h("label", {}, "From snapshot", snapSelect),
    h("label", {}, "TTL (s)", h("input", { name: "ttl", type: "number", min: "0", placeholder: "server default" })),
    h("button", { type: "submit" }, "Create"));
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const f = new FormData(form);
    const body = { type: f.get("type") };
    if (f.get("name")) body.name = f.get("name");
    if (f.get("fromSnapshot")) body.fromSnapshot = f.get("fromSnapshot");
    else if (f.get("image")) body.image = f.get("image");
    if (f.get("runtime")) body.runtime = f.get("runtime");
    if (f.get("ttl") !== "") body.ttl = Number(f.get("ttl"));
    const btn = form.querySelector("button");
    btn.disabled = true;
    const out = await attempt(() => api("POST", "/v1/sandboxes", body));
    btn.disabled = false;
    if (out) {
      showInfo(`creating ${out.sandbox.id}`);
      form.reset();
    }
    refresh();
  });
  return form;
}

// Each listed sandbox's cost since it was made (running and stored time; its snapshots are the account's), by id.
async function sandboxCosts(sandboxes) {
  if (!sandboxes.length) return new Map();
  const first = sandboxes.map((sb) => sb.createdAt).sort()[0].slice(0, 10);
  try {
    const usage = await api("GET", `/v1/usage?by=sandbox&from=${first}`);
    return new Map(usage.groups.map((g) => [g.key, g.cost]));
  } catch (e) {
    if (e.status === 401) throw e;
    return new Map();
  }
}

export function render(root) {
  const tbody = h("tbody");
  const table = h("table", { class: "list", id: "sandboxes" },
    h("thead", {}, h("tr", {}, ["Name", "State", "Size", "Age", "Memory", "CPU", "Cost so far", ""].map((c) => h("th", {}, c)))), tbody);
  const empty = h("p", { class: "empty", hidden: true }, "No sandboxes yet: create one above.");
  let busy = false;
  let stopped = false;
  const refresh = async () => {
    if (busy || stopped) return;
    busy = true;
    try {
      const { sandboxes } = await api("GET", "/v1/sandboxes");
      const costs = await sandboxCosts(sandboxes);
      if (stopped || document.querySelector("dialog[open]")) return;  // keep the rows while a form is open
      tbody.replaceChildren(...sandboxes.map((sb) => row(sb, refresh, costs)));
      empty.hidden = sandboxes.length > 0;
    } catch (e) {
      if (e.status !== 401) attempt(() => { throw e; });
    } finally {
      busy = false;
    }
  };
  root.append(h("h1", {}, "Sandboxes"), createForm(refresh), h("div", { class: "scroll" }, table), empty);
  refresh();
  const timer = setInterval(refresh, POLL_MS);
  return () => { stopped = true; clearInterval(timer); };
}
