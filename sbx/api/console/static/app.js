// The console's shell: sign-in, navigation and the hash router (#/sandboxes, #/sandbox/ID, #/terminal/ID,
// #/files/ID, #/usage, #/nodes). Each page module exports render(root, params) and may return a cleanup function,
// called when the page is left (timers, sockets).
import { api, setSession, whenSignedOut } from "./api.js";
import { clearBanner, showError } from "./util.js";
import * as sandboxes from "./pages/sandboxes.js";
import * as sandbox from "./pages/sandbox.js";
import * as terminal from "./pages/terminal.js";
import * as files from "./pages/files.js";
import * as usage from "./pages/usage.js";
import * as nodes from "./pages/nodes.js";

const PAGES = { sandboxes, sandbox, terminal, files, usage, nodes };
let cleanup = null;

function signedIn(yes) {
  document.getElementById("signin").hidden = yes;
  document.getElementById("nav").hidden = !yes;
  document.getElementById("page").hidden = !yes;
  document.body.dataset.signedIn = yes ? "1" : "0";
}

function leave() {
  if (cleanup) {
    try { cleanup(); } catch (e) { console.error(e); }
    cleanup = null;
  }
}

function route() {
  leave();
  clearBanner();
  const [name, ...rest] = (location.hash.replace(/^#\/?/, "") || "sandboxes").split("/");
  const page = PAGES[name] || sandboxes;
  for (const a of document.querySelectorAll("#nav a")) {
    a.classList.toggle("active", a.dataset.page === name || (name === "sandbox" && a.dataset.page === "sandboxes"));
  }
  const root = document.getElementById("page");
  root.replaceChildren();
  root.dataset.page = PAGES[name] ? name : "sandboxes";
  try {
    cleanup = page.render(root, rest.map(decodeURIComponent)) || null;
  } catch (e) {
    showError(e);
  }
}

function showSignIn() {
  leave();
  setSession(null);
  signedIn(false);
  document.getElementById("page").replaceChildren();
  document.getElementById("signin-key").focus();
}

async function start() {
  whenSignedOut(showSignIn);
  document.getElementById("signin-form").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const keyInput = document.getElementById("signin-key");
    const out = document.getElementById("signin-error");
    out.textContent = "";
    try {
      const { session } = await api("POST", "/v1/console/session", { key: keyInput.value });
      keyInput.value = "";
      setSession(session);
      signedIn(true);
      route();
    } catch (e) {
      out.textContent = e.code ? `${e.code}: ${e.message}` : String(e);
    }
  });
  document.getElementById("signout").addEventListener("click", async () => {
    try { await api("DELETE", "/v1/console/session"); } catch (e) { showError(e); }
    showSignIn();
  });
  window.addEventListener("hashchange", () => { if (document.body.dataset.signedIn === "1") route(); });
  try {
    const { session } = await api("GET", "/v1/console/session");
    setSession(session);
    signedIn(true);
    route();
  } catch {
    showSignIn();
  }
}

start();
