// A terminal in the sandbox: xterm.js over the PTY WebSocket (/v1/sandboxes/{id}/pty), with the session cookie and
// its CSRF token; keyboard bytes go as binary frames, the size as {"type":"resize"} whenever the page resizes.
import { Terminal } from "../vendor/xterm.js";
import { FitAddon } from "../vendor/addon-fit.js";
import { csrfToken, sid } from "../api.js";
import { h } from "../util.js";

export function render(root, [sandboxId]) {
  const id = sid(sandboxId);
  const status = h("span", { class: "sub", id: "term-status" }, "connecting…");
  const box = h("div", { class: "terminal", id: "terminal" });
  root.append(h("div", { class: "head" }, h("h1", {}, `Terminal: ${sandboxId}`), status,
    h("div", { class: "actions" }, h("a", { class: "button secondary", href: `#/sandbox/${id}` }, "Sandbox"),
      h("a", { class: "button secondary", href: `#/files/${id}` }, "Files"))), box);
  const term = new Terminal({ cursorBlink: true, fontSize: 14, convertEol: false, scrollback: 5000,
    fontFamily: "ui-monospace, 'DejaVu Sans Mono', monospace" });
  const fit = new FitAddon();
  term.loadAddon(fit);
  term.open(box);
  fit.fit();
  const proto = location.protocol === "https:" ? "wss:" : "ws:";
  const q = new URLSearchParams({ cols: term.cols, rows: term.rows, csrf: csrfToken() || "" });
  const ws = new WebSocket(`${proto}//${location.host}/v1/sandboxes/${id}/pty?${q}`);
  ws.binaryType = "arraybuffer";
  const enc = new TextEncoder();
  ws.onopen = () => { status.textContent = "connected"; term.focus(); };
  ws.onmessage = (ev) => {
    if (typeof ev.data === "string") {
      const msg = JSON.parse(ev.data);
      if (msg.type === "exit") status.textContent = `exited with ${msg.exitCode}`;
      if (msg.type === "error") {
        status.textContent = `${msg.code}: ${msg.message}`;
        term.write(`\r\n\x1b[31m${msg.code}: ${msg.message}\x1b[0m\r\n`);
      }
      return;
    }
    term.write(new Uint8Array(ev.data));
  };
  ws.onclose = () => { if (status.textContent === "connected") status.textContent = "closed"; };
  const input = term.onData((d) => { if (ws.readyState === WebSocket.OPEN) ws.send(enc.encode(d)); });
  const resized = term.onResize(({ cols, rows }) => {
    if (ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify({ type: "resize", cols, rows }));
  });
  const ro = new ResizeObserver(() => { try { fit.fit(); } catch { /* hidden */ } });
  ro.observe(box);
  window.sbxTerminal = term;  // for the browser tests: what the screen shows
  return () => {
    ro.disconnect();
    input.dispose();
    resized.dispose();
    ws.close();
    term.dispose();
    delete window.sbxTerminal;
  };
}
