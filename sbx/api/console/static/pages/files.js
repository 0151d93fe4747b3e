// Files: browse the sandbox user's home (and below), download a file, upload by picking or dragging files onto
// the page (PUT /v1/sandboxes/{id}/files, streamed into the sandbox).
import { api, sid } from "../api.js";
import { attempt, bytes, h, showInfo } from "../util.js";

export function render(root, [sandboxId, ...rest]) {
  const id = sid(sandboxId);
  let dir = rest.length ? rest.join("/") : "~";
  const crumbs = h("div", { class: "crumbs", id: "crumbs" });
  const tbody = h("tbody");
  const table = h("table", { class: "list files", id: "files" },
    h("thead", {}, h("tr", {}, ["Name", "Size", "Modified", ""].map((c) => h("th", {}, c)))), tbody);
  const picker = h("input", { type: "file", multiple: true, id: "upload-input" });
  const drop = h("div", { class: "drop", id: "drop" }, "Drop files here to upload them to this folder, or ", picker);
  root.append(h("div", { class: "head" }, h("h1", {}, `Files: ${sandboxId}`),
    h("div", { class: "actions" }, h("a", { class: "button secondary", href: `#/sandbox/${id}` }, "Sandbox"),
      h("a", { class: "button secondary", href: `#/terminal/${id}` }, "Terminal"))), crumbs, drop,
  h("div", { class: "scroll" }, table));

  const join = (a, b) => (a.endsWith("/") ? a + b : `${a}/${b}`);
  const link = (path) => `/v1/sandboxes/${id}/files?${new URLSearchParams({ path })}`;

  async function load() {
    const out = await attempt(() => api("GET", `/v1/sandboxes/${id}/files/list?${new URLSearchParams({ path: dir })}`));
    if (!out) return;
    const parts = dir.split("/").filter(Boolean);
    crumbs.replaceChildren(...parts.map((p, i) => {
      const to = (dir.startsWith("/") ? "/" : "") + parts.slice(0, i + 1).join("/");
      return h("a", { href: "#", onclick: (ev) => { ev.preventDefault(); dir = to; load(); } }, p);
    }).flatMap((a, i) => (i ? [" / ", a] : [a])));
    const rows = [];
    if (parts.length > 1 || dir.startsWith("/")) {
      const up = (dir.startsWith("/") ? "/" : "") + parts.slice(0, -1).join("/");
      rows.push(h("tr", {}, h("td", { colspan: 4 }, h("a", { href: "#", onclick: (ev) => { ev.preventDefault(); dir = up || "/"; load(); } }, ".."))));
    }
    for (const e of out.entries) {
      const isDir = e.type === "directory";
      const name = isDir
        ? h("a", { href: "#", class: "dir", onclick: (ev) => { ev.preventDefault(); dir = join(dir, e.name); load(); } }, `${e.name}/`)
        : h("span", {}, e.name);
      const del = h("button", { type: "button", class: "danger small", onclick: async () => {
        if (!confirm(`Remove ${e.path}${isDir ? " and everything in it" : ""}?`)) return;
        await attempt(() => api("DELETE", `/v1/sandboxes/${id}/files?${new URLSearchParams({ path: e.path })}`));
        load();
      } }, "Remove");
      rows.push(h("tr", { "data-name": e.name, "data-type": e.type },
        h("td", { "data-label": "Name" }, name),
        h("td", { "data-label": "Size", class: "num" }, isDir ? "–" : bytes(e.size)),
        h("td", { "data-label": "Modified" }, new Date(e.mtime * 1000).toLocaleString()),
        h("td", {}, h("div", { class: "actions" },
          isDir ? null : h("a", { class: "button secondary small", href: link(e.path), download: e.name }, "Download"), del))));
    }
    if (!out.entries.length) rows.push(h("tr", {}, h("td", { colspan: 4, class: "empty" }, "Empty folder.")));
    tbody.replaceChildren(...rows);
  }

  async function upload(fileList) {
    for (const f of fileList) {
      const out = await attempt(() => api("PUT", link(join(dir, f.name)), f));
      if (out) showInfo(`uploaded ${f.name} (${bytes(out.size)})`);
    }
    load();
  }
  picker.addEventListener("change", () => { upload([...picker.files]); picker.value = ""; });
  const over = (ev) => { ev.preventDefault(); drop.classList.add("over"); };
  const leave = () => drop.classList.remove("over");
  const dropped = (ev) => { ev.preventDefault(); leave(); if (ev.dataTransfer?.files?.length) upload([...ev.dataTransfer.files]); };
  root.addEventListener("dragover", over);
  root.addEventListener("dragleave", leave);
  root.addEventListener("drop", dropped);
  load();
  return () => {
    root.removeEventListener("dragover", over);
    root.removeEventListener("dragleave", leave);
    root.removeEventListener("drop", dropped);
  };
}
