// The console's way to the sbx API: same-origin fetches that carry the session cookie, the session's CSRF token
// on every change, and errors as the API words them ({"error": {"code", "message"}}).

let csrf = null;
let onSignedOut = () => {};

export class ApiError extends Error {
  constructor(status, code, message) {
    super(message);
    this.status = status;
    this.code = code;
  }
  toString() { return `${this.code}: ${this.message}`; }
}

export function setSession(session) { csrf = session ? session.csrf : null; }
export function csrfToken() { return csrf; }
export function whenSignedOut(fn) { onSignedOut = fn; }

async function failure(r) {
  try {
    const e = (await r.json()).error;
    return new ApiError(r.status, e.code, e.message);
  } catch {
    return new ApiError(r.status, `http_${r.status}`, r.statusText || "request failed");
  }
}

// method, path, and a JSON body (an object), or raw bytes (a Blob/File). Resolves to the JSON answer, or the
// Response itself with {raw: true}. Rejects with an ApiError.
export async function api(method, path, body, { raw = false } = {}) {
  const headers = {};
  let payload;
  if (method !== "GET" && method !== "HEAD" && csrf) headers["X-Sbx-Csrf"] = csrf;
  if (body instanceof Blob) {
    payload = body;
    headers["Content-Type"] = "application/octet-stream";
  } else if (body !== undefined) {
    payload = JSON.stringify(body);
    headers["Content-Type"] = "application/json";
  }
  const r = await fetch(path, { method, headers, body: payload, credentials: "same-origin" });
  if (!r.ok) {
    const err = await failure(r);
    if (r.status === 401 && !path.startsWith("/v1/console/session")) onSignedOut();
    throw err;
  }
  return raw ? r : r.json();
}

// The lines of an NDJSON answer (events, job logs), parsed.
export async function ndjson(path) {
  const r = await api("GET", path, undefined, { raw: true });
  const text = await r.text();
  return text.split("\n").filter((l) => l.trim()).map((l) => JSON.parse(l));
}

export const sid = (id) => encodeURIComponent(id);
