// The pages' one way to the server: the JSON admin API (/admin/v1), the same routes a script
// calls with the admin token. The session cookie rides along; state-changing calls carry the
// CSRF token from the tessera_csrf cookie in X-CSRF-Token. Failures become ApiFailure with a
// sentence a person can act on.

export class ApiFailure extends Error {
  constructor(message, status, code) {
    super(message);
    this.status = status;
    this.code = code;
  }

  /** True when the route does not exist on this server (a feature not deployed yet). */
  get unavailable() {
    return this.status === 404 && this.code === "unknown_url";
  }
}

function csrfToken() {
  const m = document.cookie.match(/(?:^|;\s*)tessera_csrf=([^;]+)/);
  return m ? decodeURIComponent(m[1]) : "";
}

export function signInAgain() {
  location.assign(`/admin/login?next=${encodeURIComponent(location.pathname + location.search)}`);
}

function sentence(text) {
  const s = String(text).trim();
  return /[.!?)]$/.test(s) ? s : `${s}.`;
}

function explain(status, body) {
  const err = body && body.error ? body.error : {};
  if (status === 0) return "Could not reach the server. Check that Tessera is running and try again.";
  if (status === 401) return "Your session has ended. Sign in again.";
  if (err.code === "csrf_failed") return "This page's security token is missing or old. Reload the page and try again.";
  if (status === 404 && err.code === "unknown_url") return "This feature is not available on this server yet.";
  if (status === 413) return "The upload is larger than this server accepts.";
  if (status === 503) return sentence(err.message || "The server is busy or its database is unavailable; try again shortly");
  if (status >= 500) return "Something went wrong on the server; nothing was changed. Try again, and check the server log if it keeps happening.";
  return err.message ? sentence(err.message) : `The server refused the request (HTTP ${status}).`;
}

// Integers past 2^53 (billing's exact amounts in picos) would lose digits as Numbers: with the
// parser's source text (Chromium 114+, Firefox 135+, Safari 18.4+) they become BigInt instead.
function exactIntegers(key, value, context) {
  if (typeof value === "number" && !Number.isSafeInteger(value) && context && /^-?\d+$/.test(context.source)) {
    return BigInt(context.source);
  }
  return value;
}

async function parse(r) {
  const text = await r.text();
  try {
    return text ? JSON.parse(text, exactIntegers) : null;
  } catch {
    return null;
  }
}

/** Call the admin API: api("GET", "/tenants"), api("POST", "/tenants", {name}). */
export async function api(method, path, body) {
  const headers = { accept: "application/json" };
  if (method !== "GET") headers["x-csrf-token"] = csrfToken();
  const init = { method, headers, credentials: "same-origin" };
  if (body !== undefined) {
    headers["content-type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  let r;
  try {
    r = await fetch(`/admin/v1${path}`, init);
  } catch {
    throw new ApiFailure(explain(0), 0, "network");
  }
  const data = await parse(r);
  if (r.status === 401) {
    signInAgain();
    throw new ApiFailure(explain(401), 401, "signed_out");
  }
  if (!r.ok) throw new ApiFailure(explain(r.status, data), r.status, data?.error?.code);
  return data;
}

/** Multipart upload with progress: onProgress(sent, total) while the bytes go out, then
 * onSent() once they are all sent and the server is working on them. */
export function upload(path, formData, { onProgress, onSent } = {}) {
  return new Promise((resolve, reject) => {
    const xhr = new XMLHttpRequest();
    xhr.open("POST", `/admin/v1${path}`);
    xhr.setRequestHeader("x-csrf-token", csrfToken());
    xhr.setRequestHeader("accept", "application/json");
    xhr.upload.addEventListener("progress", (e) => {
      if (e.lengthComputable && onProgress) onProgress(e.loaded, e.total);
    });
    xhr.upload.addEventListener("load", () => onSent && onSent());
    xhr.addEventListener("load", () => {
      let data = null;
      try {
        data = xhr.responseText ? JSON.parse(xhr.responseText) : null;
      } catch {
        data = null;
      }
      if (xhr.status === 401) {
        signInAgain();
        reject(new ApiFailure(explain(401), 401, "signed_out"));
      } else if (xhr.status >= 200 && xhr.status < 300) {
        resolve(data);
      } else {
        reject(new ApiFailure(explain(xhr.status, data), xhr.status, data?.error?.code));
      }
    });
    xhr.addEventListener("error", () => reject(new ApiFailure(explain(0), 0, "network")));
    xhr.send(formData);
  });
}

export async function signOut() {
  try {
    await fetch("/admin/session", { method: "DELETE", credentials: "same-origin" });
  } finally {
    location.assign("/admin/login");
  }
}
