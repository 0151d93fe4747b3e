// Small helpers shared by the pages: elements, formatting, the error banner.

export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else if (k === "class") el.className = v;
    else if (k === "dataset") Object.assign(el.dataset, v);
    else el.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children.flat()) {
    if (c === undefined || c === null || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

export function showError(err) {
  const b = document.getElementById("banner");
  b.textContent = err && err.code ? `${err.code}: ${err.message}` : String(err);
  b.hidden = false;
  b.className = "banner error";
  clearTimeout(showError.timer);
  showError.timer = setTimeout(() => { b.hidden = true; }, 15000);
}

export function showInfo(text) {
  const b = document.getElementById("banner");
  b.textContent = text;
  b.hidden = false;
  b.className = "banner info";
  clearTimeout(showError.timer);
  showError.timer = setTimeout(() => { b.hidden = true; }, 5000);
}

export function clearBanner() { document.getElementById("banner").hidden = true; }

// Run an action; show its error as the API words it. Resolves to the action's value (or undefined on error).
export async function attempt(fn) {
  try {
    return await fn();
  } catch (e) {
    showError(e);
    return undefined;
  }
}

export function age(iso) {
  const s = Math.max(0, (Date.now() - Date.parse(iso)) / 1000);
  if (s < 60) return `${Math.floor(s)}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m`;
  if (s < 86400) return `${Math.floor(s / 3600)}h ${Math.floor((s % 3600) / 60)}m`;
  return `${Math.floor(s / 86400)}d ${Math.floor((s % 86400) / 3600)}h`;
}

export function bytes(n) {
  if (n < 1024) return `${n} B`;
  const units = ["KiB", "MiB", "GiB", "TiB"];
  let v = n / 1024;
  let i = 0;
  while (v >= 1024 && i < units.length - 1) { v /= 1024; i++; }
  return `${v.toFixed(v < 10 ? 1 : 0)} ${units[i]}`;
}

export const SIZES = ["small", "default", "large", "xlarge"];

export function stateBadge(state) { return h("span", { class: `state state-${state}`, "data-state": state }, state); }

export async function copyText(text, button) {
  try {
    await navigator.clipboard.writeText(text);
  } catch {  // no clipboard permission (plain http on another host): select the text for a manual copy
    const t = h("textarea", {}, text);
    document.body.append(t);
    t.select();
    document.execCommand("copy");
    t.remove();
  }
  const old = button.textContent;
  button.textContent = "Copied";
  setTimeout(() => { button.textContent = old; }, 1500);
}

// A modal form: fields [{name, label, type, options, value, placeholder}], resolves to the values or null.
export function ask(title, fields, submitLabel = "OK") {
  return new Promise((resolve) => {
    const inputs = {};
    const rows = fields.map((f) => {
      let input;
      if (f.options) {
        input = h("select", { name: f.name }, f.options.map((o) => h("option", { value: o, selected: o === f.value }, o)));
      } else {
        input = h("input", { name: f.name, type: f.type || "text", value: f.value ?? "", placeholder: f.placeholder || "",
          required: f.required });
      }
      inputs[f.name] = input;
      return h("label", {}, f.label, input);
    });
    const dlg = h("dialog", { class: "ask" },
      h("form", { method: "dialog" }, h("h2", {}, title), rows,
        h("div", { class: "buttons" },
          h("button", { value: "cancel", type: "button", class: "secondary", onclick: () => dlg.close("cancel") }, "Cancel"),
          h("button", { value: "ok", type: "submit" }, submitLabel))));
    dlg.addEventListener("close", () => {
      const out = dlg.returnValue === "ok" ? Object.fromEntries(Object.entries(inputs).map(([k, v]) => [k, v.value])) : null;
      dlg.remove();
      resolve(out);
    });
    document.body.append(dlg);
    dlg.showModal();
  });
}
