// Nodes (the installation's admin key): each node agent's status, capacity, load and sandboxes from GET /v1/nodes,
// polled every few seconds, with cordon/uncordon buttons. An account's key gets the API's 403 admin_only, shown
// as it is worded. A node drained or emptied by consolidation (cordoned, empty, added) shows "cordoned, removable".
import { api, sid } from "../api.js";
import { attempt, bytes, h, showError } from "../util.js";

const POLL_MS = 3000;

function row(n, refresh) {
  const flip = n.cordoned ? "uncordon" : "cordon";
  return h("tr", { "data-node": n.name },
    h("td", { "data-label": "Node" }, n.name),
    h("td", { "data-label": "Status" }, h("span", { class: `state state-${n.status}`, "data-status": n.status },
      n.removable ? `${n.status}, removable` : n.status)),
    h("td", { "data-label": "Memory", class: "num" }, bytes(n.capacity.memoryMiB * 1024 * 1024)),
    h("td", { "data-label": "Disk free", class: "num" }, bytes(n.capacity.diskFreeBytes)),
    h("td", { "data-label": "vCPUs", class: "num" }, String(n.capacity.vcpus)),
    h("td", { "data-label": "Load", class: "num" }, n.load.load1.toFixed(2)),
    h("td", { "data-label": "Running", class: "num" }, String(n.load.running)),
    h("td", { "data-label": "Sandboxes", class: "num" }, String(n.sandboxes)),
    h("td", { "data-label": "CPU" }, n.fingerprint.cpuModel || ""),
    h("td", { "data-label": "" }, h("button", { type: "button", class: "secondary", "data-action": flip,
      onclick: async (ev) => {
        ev.target.disabled = true;
        await attempt(() => api("POST", `/v1/nodes/${sid(n.name)}/${flip}`, {}));
        refresh();
      } }, flip === "cordon" ? "Cordon" : "Uncordon")));
}

export function render(root) {
  const body = h("tbody", {});
  const note = h("p", { class: "empty", hidden: true });
  root.append(h("h1", {}, "Nodes"), note,
    h("table", { class: "list", id: "nodes" }, h("thead", {}, h("tr", {},
      ...["Node", "Status", "Memory", "Disk free", "vCPUs", "Load", "Running", "Sandboxes", "CPU", ""]
        .map((c) => h("th", {}, c)))), body));
  let stopped = false;
  const refresh = async () => {
    try {
      const { nodes } = await api("GET", "/v1/nodes");
      body.replaceChildren(...nodes.map((n) => row(n, refresh)));
      note.hidden = true;
    } catch (e) {
      if (e.status === 403) {
        note.textContent = `${e.code}: ${e.message}`;
        note.hidden = false;
      } else {
        showError(e);
      }
    }
  };
  refresh();
  const timer = setInterval(() => { if (!stopped) refresh(); }, POLL_MS);
  return () => { stopped = true; clearInterval(timer); };
}
